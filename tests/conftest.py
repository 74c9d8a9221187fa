"""Shared test settings and helpers: gloo on loopback, one thread per process, deterministic
seeds, the repository root, a run in one process, the tiny backbone and fit set.

The test tree mirrors the package (``tests/<layer>/test_<module>.py``); this file's folder is
on ``sys.path``, so the tests import ``REPO`` and ``train_local`` from here, and ``procs``
(processes by PID) and ``cluster`` (the real SLURM) beside it.
"""
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


def train_local(cfg):
    """Train ``cfg`` with every node in this process (the single-process backend); the report."""
    from admm_dist.engine.dist import distributed, read_env
    from admm_dist.training.trainer import Trainer

    with distributed("cpu", env=read_env({})) as ctx:
        return Trainer(cfg, ctx).train()


def cli_rank(argv):
    """One rank of ``torchrun -m admm_dist.train ARGV`` (to run under
    :func:`admm_dist.engine.launcher.launch_cpu` with ``setup=False``, which is torchrun's agent
    without an interpreter start-up per rank): exits with the command's exit code, else returns
    the elastic attempt it finished in."""
    import sys

    from admm_dist.cli import train
    rc = train.main(argv)
    if rc:
        sys.exit(rc)
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """``tiny_assets(n_agents)``: a tiny random Qwen3 backbone (built offline) and a synthetic
    DPO fit set of 16 examples per seat, built once per chain length."""
    made = {}

    def build(n_agents: int) -> dict:
        if n_agents not in made:
            from transformers import AutoTokenizer

            from admm_dist.testing.synthetic import write_fitset
            from admm_dist.testing.tiny import save_tiny_backbone

            d = tmp_path_factory.mktemp(f"tiny{n_agents}")
            bb = save_tiny_backbone(str(d / "backbone"), seed=1, hidden=32, layers=2, heads=2)
            settings = {"task": "synthetic", "n_agents": n_agents, "adapt_roles": "all"}
            fit = write_fitset(str(d / "dpo.jsonl"), settings=settings, per_seat=16,
                               tokenizer=AutoTokenizer.from_pretrained(bb))
            made[n_agents] = {"backbone": bb, "fit": fit, "settings": settings}
        return made[n_agents]
    return build
