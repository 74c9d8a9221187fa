"""The consensus modes: their names, which of them mix neighbours, and their settings' check."""
from __future__ import annotations

from admm_dist.core.errors import UserError
from admm_dist.engine.comm.topology import TOPOLOGIES

MODES = ("coordinator", "ring", "gossip", "decentralized")
MIXING = ("gossip", "decentralized")   # neighbour mixing: each node keeps its own z_i
DECENTRALIZED = "decentralized"


def check_mode(mode: str, topology: str, gossip_steps: int) -> None:
    if mode not in MODES:
        raise UserError(f"consensus={mode!r} is unknown: choose one of {', '.join(MODES)}")
    if topology not in TOPOLOGIES:
        raise UserError(f"topology={topology!r} is unknown: choose one of {', '.join(TOPOLOGIES)}")
    if mode == "gossip" and gossip_steps < 1:
        raise UserError(f"gossip_steps={gossip_steps}: gossip needs at least one mixing step (>= 1)")
    if mode == DECENTRALIZED and gossip_steps != 1:
        raise UserError(f"gossip_steps={gossip_steps}: consensus decentralized exchanges once per round; "
                        "gossip_steps is for consensus gossip (drop it, or set gossip_steps=1)")
