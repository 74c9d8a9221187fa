"""Run a function on N CPU ranks through torch's elastic launcher (what torchrun uses).

Used by the multi-process tests and the benchmarks: every worker gets the
same environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), so :func:`admm_dist.engine.dist.distributed` is exercised
exactly as in a real job. The rendezvous is ``c10d`` on ``localhost:0`` (a free
port) and gloo is bound to loopback.

``fn(ctx, *args)`` must be a module-level function (workers are spawned).
A worker exception fails the whole launch; every collective is bounded by
``timeout_s`` so that a deadlock fails instead of hanging.
"""
from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Dict

import torch

from admm_dist.core.constants import DEFAULT_TIMEOUT_S
from admm_dist.engine.dist import distributed


def _worker(fn: Callable[..., Any], timeout_s: float, threads: int, setup: bool,
            args: tuple) -> Any:
    torch.set_num_threads(threads)
    if not setup:
        return fn(*args)
    with distributed("cpu", timeout_s=timeout_s) as ctx:
        return fn(ctx, *args)


def launch_cpu(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
               threads: int = 1, max_restarts: int = 0, setup: bool = True) -> Dict[int, Any]:
    """Run ``fn`` on ``nprocs`` gloo ranks; returns {rank: return value}.

    With ``setup=False`` the worker calls ``fn(*args)`` and creates the process
    group itself (to test :func:`admm_dist.engine.dist.distributed`).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"admm-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
        monitor_interval=0.05, start_method="spawn", rdzv_timeout=int(timeout_s) + 30)
    return elastic_launch(config, _worker)(fn, timeout_s, threads, setup, args)
