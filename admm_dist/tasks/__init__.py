"""Task registry: every task returns items ``{question, gold, answer_type, anchor, ...}``.

Real tasks (gsm8k, aime, gpqa, ...) register here with loaders that read a public data set
or a local JSON/JSONL file; the synthetic ``chain_arith`` task serves the tiny stand-in
backbone. :func:`get` resolves a name with a clear error; :func:`load` returns the items.

The ``tasks`` layer owns the task registry (:mod:`~admm_dist.tasks.registry`), the loaders
(:mod:`~admm_dist.tasks.common` and one module per family), scoring
(:mod:`~admm_dist.tasks.scoring`) and the code sandbox (:mod:`~admm_dist.tasks.sandbox`, with
bubblewrap's command line in :mod:`~admm_dist.tasks.bubblewrap`). It imports only
:mod:`admm_dist.core`.
"""
# the task modules register themselves; the registry's names are the package's face
from admm_dist.tasks import chain_arith, choice, coding, reasoning, safety  # noqa: E402,F401
from admm_dist.tasks.registry import (ANSWER_TYPES, REGISTRY, TaskSpec, get, load, register,  # noqa: F401
                                      score)
