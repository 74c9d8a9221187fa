"""Seats of the chain: which carry an adapter, which run on another backbone, and how seats
generate. One definition of each choice list, used by training, evaluation and the tools.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from admm_dist.core.errors import UserError

ROLE_SETS = ("all", "nonsink", "middle")      # adapt_roles: which seats carry an adapter
GENERATION_BACKENDS = ("hf", "vllm")          # generation_backend: transformers or vLLM


def adapted_seats(adapt_roles: str, n_agents: int) -> List[int]:
    """The seats that carry an adapter: all, nonsink (not the last) or middle (neither end)."""
    n = n_agents
    return {"all": list(range(n)), "nonsink": list(range(n - 1)),
            "middle": list(range(1, n - 1))}[adapt_roles]


def parse_agent_models(spec: Optional[str], n_agents: int) -> Dict[int, str]:
    """``SEAT=PATH[,SEAT=PATH]`` (a seat on another backbone) as {seat: path or hub id}."""
    out: Dict[int, str] = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        seat, eq, path = part.partition("=")
        if not eq or not seat.strip().isdigit() or not path.strip():
            raise UserError(f"agent_models {part!r}: write SEAT=PATH with SEAT a seat number, e.g. "
                            "1=path/to/model")
        k = int(seat)
        if not 0 <= k < n_agents:
            raise UserError(f"agent_models: unknown seat {k}: a chain of {n_agents} seats has seats "
                            f"0..{n_agents - 1}")
        if k in out:
            raise UserError(f"agent_models: seat {k} is given twice")
        out[k] = path.strip()
    return out
