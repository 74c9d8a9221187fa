"""Run a function on N CPU ranks through torch's elastic launcher (what torchrun uses).

Used by the multi-process tests and the benchmarks: every worker gets the
same environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), so :func:`admm_dist.engine.dist.distributed` is exercised
exactly as in a real job. The rendezvous is ``c10d`` on ``localhost:0`` (a free
port) and gloo is bound to loopback.

``fn(ctx, *args)`` must be a module-level function. A worker exception fails the whole
launch; every collective is bounded by ``timeout_s`` so that a deadlock fails instead of
hanging.

Workers start from the process's fork server (:mod:`admm_dist.training.workers`: torch,
transformers and PEFT are imported once per calling process, not once per worker), which makes a
launch about 2 s cheaper on a 2-core machine. A forked worker is made to start as a spawned one
would: the caller's current environment, working directory, ``sys.path``, stdout and stderr are
sent along with ``fn``'s module and name and adopted before ``fn`` is imported by that name (the
launcher's own variables, RANK and the rest, stay the launcher's). A function of a module run by
``python -m`` (``__main__``) is found there by the module's own name; one of a script
(``python file.py``) is spawned instead, which the fork server cannot import.
"""
from __future__ import annotations

import importlib
import os
import sys
import uuid
from typing import Any, Callable, Dict, Mapping

import torch

from admm_dist.core.constants import DEFAULT_TIMEOUT_S
from admm_dist.engine.dist import distributed
from admm_dist.training import workers

# what the elastic launcher sets in a worker's environment (the rest is the caller's)
_LAUNCHER_VARS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"})


def _launchers(name: str) -> bool:
    return name in _LAUNCHER_VARS or name.startswith("TORCHELASTIC_")


def _module_of(fn: Callable[..., Any]) -> str | None:
    """The name the fork server imports ``fn``'s module by: a ``python -m`` module's own name for
    ``__main__``; None for a script's function (no name to import it by)."""
    module = getattr(fn, "__module__", "__main__")
    if module != "__main__":
        return module
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None else None


def _caller_state(fn: Callable[..., Any]) -> Dict[str, Any]:
    return {**workers.caller_state(), "fn": (_module_of(fn), fn.__qualname__)}


def _become_caller(state: Mapping[str, Any]) -> Callable[..., Any]:
    """In a forked worker: the caller's state (:func:`~admm_dist.training.workers.adopt`), the
    launcher's own variables kept; then ``fn``, imported by its module and name."""
    workers.adopt(state, keep=_launchers)
    module, name = state["fn"]
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


def _worker(fn: Callable[..., Any], timeout_s: float, threads: int, setup: bool,
            args: tuple, caller: Any = None) -> Any:
    if caller is not None:
        fn = _become_caller(caller)
    torch.set_num_threads(threads)
    if not setup:
        return fn(*args)
    with distributed("cpu", timeout_s=timeout_s) as ctx:
        return fn(ctx, *args)


def _start_method(fn: Callable[..., Any]) -> str:
    if _module_of(fn) is None:
        return "spawn"
    workers.context()      # its preload list, if this launch starts the server
    return "forkserver"


def launch_cpu(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
               threads: int = 1, max_restarts: int = 0, setup: bool = True) -> Dict[int, Any]:
    """Run ``fn`` on ``nprocs`` gloo ranks; returns {rank: return value}.

    With ``setup=False`` the worker calls ``fn(*args)`` and creates the process
    group itself (to test :func:`admm_dist.engine.dist.distributed`).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    start_method = _start_method(fn)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"admm-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
        monitor_interval=0.05, start_method=start_method, rdzv_timeout=int(timeout_s) + 30)
    if start_method == "spawn":
        return elastic_launch(config, _worker)(fn, timeout_s, threads, setup, args)
    return elastic_launch(config, _worker)(None, timeout_s, threads, setup, args, _caller_state(fn))
