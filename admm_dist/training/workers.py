"""Worker processes forked from the one fork server a process has.

multiprocessing keeps one fork server per process, and its preload list is fixed by whichever
caller starts it first; so the package sets that list in one place, :func:`context`:
:data:`PRELOAD`, the heavy imports its workers need (torch, transformers, PEFT, the trainer, the
rehearsal), made once in the server instead of once per worker (about 6 s of CPU each).

A forked worker starts with the server's state, not its caller's: :func:`caller_state` is what
a caller sends along, and :func:`adopt` makes the worker take it (environment, working directory,
import path, stdout and stderr), keeping the variables that the worker's own launcher set.
:func:`adopt` also freezes what the worker inherited (``gc.freeze``): the server's imports are
never garbage, and left in the collector's generations they made each of the worker's automatic
full collections scan some 430,000 objects (0.2-0.3 s of CPU each, one or two in a short job).

Used by the CPU launcher (:mod:`admm_dist.bench.launcher`: ranks under torch's elastic agent)
and the memory plan's rehearsals (:mod:`admm_dist.training.memory_plan`).
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from typing import Any, Callable, Dict, Mapping

# imported once in the fork server; a module that fails to import is skipped there
PRELOAD = ("torch", "torch.distributed", "transformers", "peft", "admm_dist.training.trainer",
           "admm_dist.training.rehearsal")


def context() -> Any:
    """multiprocessing's fork-server context, its preload list set to :data:`PRELOAD` (which
    takes effect if this call comes before the server first starts)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def caller_state() -> Dict[str, Any]:
    """What a worker adopts from this process: its environment, working directory, import path
    and PID (whose stdout and stderr the worker writes to)."""
    return {"env": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path), "pid": os.getpid()}


def adopt(state: Mapping[str, Any], keep: Callable[[str], bool] = lambda name: False) -> None:
    """In a forked worker: become the caller of ``state`` (:func:`caller_state`), but for the
    variables of this worker's environment that ``keep`` accepts (its launcher's); freeze what
    the fork server left it."""
    gc.freeze()
    mine = {k: v for k, v in os.environ.items() if keep(k)}
    os.environ.clear()
    os.environ.update({**state["env"], **mine})
    os.chdir(state["cwd"])
    sys.path[:] = state["path"]
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        try:
            target = os.open(f"/proc/{state['pid']}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:          # closed, or not ours to open: keep the fork server's
            continue
        stream.flush()
        os.dup2(target, fd)
        os.close(target)
