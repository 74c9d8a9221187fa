"""Which communicator a launch gets (DESIGN.md section 6): ``process_group`` under torchrun,
with exactly one rank per node, or ``local`` (every node in one process) without it.
"""
from __future__ import annotations

import os

from admm_dist.core.errors import UserError
from admm_dist.engine.comm import Communicator, make_communicator
from admm_dist.engine.dist import DistContext
from admm_dist.training.config import TrainConfig


def build_communicator(cfg: TrainConfig, ctx: DistContext) -> Communicator:
    """The communicator of this launch: one rank per node under torchrun, all nodes in one
    process otherwise; a launch that does not match the run's node count is refused."""
    n = cfg.n_nodes()
    if ctx.env.is_distributed:
        if cfg.backend == "local":
            raise UserError("--backend local runs every node in one process: launch it "
                            "without torchrun (python -m admm_dist.train ...)")
        if ctx.world_size != n:
            hosts = int(os.environ.get("GROUP_WORLD_SIZE") or os.environ.get("SLURM_JOB_NUM_NODES") or 1)
            if hosts > 1:
                fix = (f"nodes x ranks per node must equal {n}: e.g. --nnodes {hosts} --nproc_per_node "
                       f"{n // hosts}" if n % hosts == 0 else
                       f"{n} nodes do not split over {hosts} hosts: use a host count that divides {n}")
            else:
                fix = f"launch with torchrun --nproc_per_node {n}"
            raise UserError(f"world size {ctx.world_size} != number of nodes {n} (one rank per node, "
                            f"{hosts} host(s)): {fix} (on SLURM: sbatch --nodes A with NPROC_PER_NODE=B, "
                            f"A x B = {n})")
        backend = "process_group"
    else:
        if cfg.backend == "process_group":
            raise UserError("--backend process_group needs torchrun: torchrun "
                            f"--nproc_per_node {n} -m admm_dist.train ...")
        backend = "local"
    return make_communicator(cfg.consensus, n_nodes=n, topology=cfg.topology,
                             gossip_steps=cfg.gossip_steps, timeout=ctx.timeout,
                             backend=backend)
