"""Which communicator a launch gets (docs/design.md section 5): ``process_group`` under torchrun,
each rank owning a contiguous block of the N nodes (one each when W = N), or ``local`` (every
node in one process) without it.
"""
from __future__ import annotations

from admm_dist.core.errors import UserError
from admm_dist.engine.comm import Communicator, make_communicator
from admm_dist.engine.dist import DistContext
from admm_dist.training.config import TrainConfig


def build_communicator(cfg: TrainConfig, ctx: DistContext) -> Communicator:
    """The communicator of this launch: a block of nodes per rank under torchrun (W <= N), all
    nodes in one process otherwise; more ranks than nodes is refused."""
    n = cfg.n_nodes()
    if ctx.env.is_distributed:
        if cfg.backend == "local":
            raise UserError("--backend local runs every node in one process: launch it "
                            "without torchrun (python -m admm_dist.train ...)")
        if ctx.world_size > n:
            raise UserError(f"world size {ctx.world_size} > number of nodes {n}: a node cannot be split over "
                            f"ranks; launch at most {n} rank(s) in all (torchrun --nproc_per_node {n}, or "
                            "fewer: several nodes then share a rank)")
        backend = "process_group"
    else:
        if cfg.backend == "process_group":
            raise UserError("--backend process_group needs torchrun: torchrun "
                            f"--nproc_per_node {n} -m admm_dist.train ...")
        backend = "local"
    return make_communicator(cfg.consensus, n_nodes=n, topology=cfg.topology,
                             gossip_steps=cfg.gossip_steps, timeout=ctx.timeout,
                             backend=backend, compress=cfg.compress)
