"""Progress bars on the loops a person waits for, drawn by tqdm where someone is watching.

A bar appears on standard error only when its caller asks for one (rank 0 of a run that is
not ``quiet``) *and* standard error is a terminal. Otherwise :func:`bar` hands the loop back
unchanged and writes nothing, so a log redirected to a file (torchrun ``--tee``, SLURM's
``--output``, a pipe) stays one line per event. :func:`say` prints a log line above any bar
on screen without tearing it.

The loops that carry one: the rounds (:mod:`admm_dist.training.trainer`), on-policy collection
by chunk (:mod:`admm_dist.mas.collection`), the chain's generation in evaluation
(:mod:`admm_dist.mas.chain`) and the reference log-probs (:mod:`admm_dist.model.objectives`).
"""
from __future__ import annotations

import sys
from typing import Iterable, Optional

from tqdm import tqdm


def watching(show: bool = True) -> bool:
    """Whether a bar asked for with ``show`` is drawn: only on a terminal."""
    try:
        return bool(show) and sys.stderr.isatty()
    except (AttributeError, ValueError):   # a closed or replaced stream
        return False


def bar(iterable: Optional[Iterable] = None, *, total: Optional[int] = None, desc: str,
        unit: str = "it", show: bool = True, initial: int = 0, leave: bool = True) -> tqdm:
    """A tqdm bar over ``iterable`` (or one updated by hand), drawn only when :func:`watching`."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=leave,
                disable=not watching(show), file=sys.stderr, dynamic_ncols=True)


def say(message: str) -> None:
    """Print one log line on standard output, above any bar on screen."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()
