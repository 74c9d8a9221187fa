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

# The files that take longest (in the default suite or in the slow one; .ci/run's durations,
# 2026-12-04), collected first, longest first: pytest-xdist hands a worker one file at a time in
# collection order (--dist loadfile), so a long file left to the end keeps one worker busy while
# the other has nothing left to do. Every other file keeps its place after them.
LONGEST_FIRST = (
    "model/test_smollm2.py", "launch/test_multinode.py", "launch/test_slurm.py",
    "engine/test_preemption.py", "training/test_trainer_placement.py", "training/test_trainer_onpolicy.py",
    "training/test_trainer.py", "bench/test_kill_resume.py", "launch/test_elastic.py",
    "bench/test_bench_fidelity.py", "launch/test_cpu_default_tracked.py", "bench/test_gpu_check.py",
    "mas/test_collection.py", "cli/test_interrupt.py",
)


def pytest_collection_modifyitems(config, items):
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests = REPO / "tests"

    def rank(item):
        try:
            return place.get(Path(str(item.fspath)).resolve().relative_to(tests).as_posix(), len(place))
        except ValueError:   # a test outside tests/ (a path given on the command line)
            return len(place)
    items.sort(key=rank)     # stable: the rest keep pytest's order


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
