"""What torchrun tells a worker about its place in the job: the one reader of ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
torchelastic's variables.

:func:`read_env` turns the environment into a :class:`DistEnv`; a process started without
torchrun is a world of size 1. The rest of the package receives a :class:`DistEnv` (or a
:class:`~admm_dist.engine.dist.DistContext`) and never looks at the environment itself.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

from admm_dist.core.errors import UserError


class DistConfigError(UserError):
    """The distributed environment is inconsistent; the message says how to fix it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistEnv:
    """What torchrun tells a worker about its place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: Optional[int] = None   # ranks on this host (torchrun's nproc_per_node)
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    agent_store: bool = False       # torchrun's agent hosts the TCPStore
    restart_count: int = 0          # which attempt of the job this is (torchrun's restarts)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise DistConfigError(f"WORLD_SIZE={self.world_size}: it must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise DistConfigError(
                f"RANK={self.rank} is outside [0, WORLD_SIZE={self.world_size}): "
                "launch with torchrun, which sets both consistently")
        if self.local_rank < 0:
            raise DistConfigError(f"LOCAL_RANK={self.local_rank}: it must be >= 0")
        if self.local_world_size is not None and not 1 <= self.local_world_size <= self.world_size:
            raise DistConfigError(f"LOCAL_WORLD_SIZE={self.local_world_size} is outside [1, WORLD_SIZE="
                                  f"{self.world_size}]: launch with torchrun, which sets both consistently")
        if self.world_size > 1 and (not self.master_addr or not self.master_port):
            raise DistConfigError(
                "WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set: "
                "launch with torchrun (e.g. torchrun --standalone --nproc_per_node N ...)")

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def per_node(self) -> int:
        """Ranks on this host: LOCAL_WORLD_SIZE where torchrun set it, else the whole world."""
        return self.local_world_size or self.world_size


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistConfigError(f"{key}={raw!r} is not an integer: unset it or launch with torchrun") from None


def read_env(env: Optional[Mapping[str, str]] = None) -> DistEnv:
    """Read torchrun's variables; without them the process is a world of size 1."""
    env = os.environ if env is None else env
    world = _int(env, "WORLD_SIZE", 1)
    port = env.get("MASTER_PORT")
    return DistEnv(
        rank=_int(env, "RANK", 0),
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", 0),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", 0) or None,
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=int(port) if port else None,
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
    )
