"""Entry point: ``torchrun --nproc_per_node N -m admm_dist.train --config configs/X.yaml [overrides]``.

Without torchrun (or with ``--backend local``) every node runs in this one
process on one backbone. Overrides are the seed's flags (``--rho 0.1``,
``--local_only``) or ``key=value``; see :mod:`admm_dist.settings` for all keys.
The process group is always torn down, on success and on failure; a bad input
ends the run with one line on stderr and a non-zero exit code.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from . import config as config_mod
from .admm import NonFiniteError
from .adapter import AdapterError
from .checkpoint import CheckpointError
from .comm import CommError
from .dist import DistConfigError, distributed
from .fitset import FitSetError
from .settings import TrainConfig
from .trainer import Preempted, TrainError, Trainer

USER_ERRORS = (config_mod.ConfigError, ValueError, TrainError, FitSetError, AdapterError,
               CheckpointError, DistConfigError, NonFiniteError, CommError)

HELP = __doc__ + "\nKeys and defaults:\n" + "\n".join(
    f"  --{k} {v!r}" for k, v in TrainConfig().as_dict().items())


def quiet_libraries() -> None:
    """Keep stderr for our own messages: no per-load progress bars or deprecation chatter."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers|peft")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_libraries()
    if any(a in ("-h", "--help") for a in argv):
        print(HELP)
        return 0
    try:
        cfg = config_mod.load(TrainConfig, argv)
    except (config_mod.ConfigError, ValueError) as e:
        print(f"admm_dist.train: error: {e}", file=sys.stderr)
        return 2
    rank = 0
    try:
        with distributed(cfg.device, timeout_s=cfg.timeout_s) as ctx:
            rank = ctx.rank
            trainer = Trainer(cfg, ctx)
            report = trainer.train()
    except Preempted as e:
        if rank == 0:
            print(f"admm_dist.train: {e}", flush=True)
        return 0
    except USER_ERRORS as e:
        print(f"admm_dist.train: error on rank {rank}: {e}", file=sys.stderr)
        return 1
    else:
        if rank == 0 and not cfg.quiet and not cfg.dry_run:
            print(f"done: {report.get('n_nodes')} node(s), delta_w_rel={report.get('delta_w_rel')}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
