"""Shared test settings and helpers: gloo on loopback, one thread per process, deterministic
seeds, the repository root, a run in one process, the tiny backbone and fit set, and the tiny
run on them (as settings, as the training command's ``key=value`` overrides, as a command).

The test tree mirrors the package (``tests/<layer>/test_<module>.py``); this file's folder is
on ``sys.path``, so the tests import ``REPO`` and ``train_local`` from here, and ``procs``
(processes by PID) and ``cluster`` (the real SLURM) beside it.
"""
import gc
import os
import sys
from pathlib import Path
from typing import List, Sequence

import pytest
import torch

# pytest rewrites the test modules' asserts as it imports them, and caches the result beside
# their bytecode unless bytecode is not to be written (PYTHONDONTWRITEBYTECODE, set on the
# machines these tests run on): then every worker of every run rewrote them again, 6 s of CPU
# each, half of a worker's collection. The cache is in __pycache__, which git ignores.
sys.dont_write_bytecode = False
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# torch's store names each peer of a connection (getnameinfo of ::ffff:127.0.0.1, which
# /etc/hosts does not list, so the resolver asks DNS): where the resolver drops a query (one in
# ~50 on the machines these tests run on), a connection waits out its 5 s timeout. Every
# process the tests start waits at most 1 s (glibc's per-process resolver options).
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:2")
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]

# The files that take longest (in the default suite or in the slow one; .ci/run's durations,
# 2026-12-07), collected first, longest first: pytest-xdist hands a worker one file at a time in
# collection order (setup.cfg: --dist loadfile, and --no-loadscope-reorder, without which it
# hands out the files with the most tests first), so a long file left to the end keeps one
# worker busy while the other has nothing left to do. Every other file keeps its place after them.
LONGEST_FIRST = (
    "launch/test_elastic.py", "model/test_smollm2.py", "launch/test_multinode.py", "benchmarks/test_calibration.py",
    "launch/test_slurm.py",
    "engine/test_preemption.py", "training/test_trainer_placement.py", "training/test_trainer_onpolicy.py",
    "training/test_trainer.py", "training/test_grpo.py", "engine/test_compressed_mp.py", "training/test_outputs.py",
    "engine/test_comm_mp.py", "training/test_trainer_seat_groups.py", "benchmarks/test_kill_resume.py",
    "benchmarks/test_bench_fidelity.py", "bench/test_gpu_check.py", "benchmarks/test_placement.py",
    "launch/test_cpu_default_tracked.py", "mas/test_collection.py", "cli/test_failures.py",
    "cli/test_interrupt.py",
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


def pytest_collection_finish(session):
    """What the test modules imported is never garbage: frozen, as a forked worker freezes what it
    inherits (``admm_dist/training/workers.py``), about one full collection per 3 s of tests
    no longer scans it."""
    gc.freeze()


def selected(request, test: str, *names: str) -> list:
    """The values of the parameters ``names`` (a tuple of them for more than one; ``[()]`` for
    none when ``test`` runs at all) that this session runs ``test`` of the requesting module with
    (what -m and -k left), in collection order: what a module's fixture runs in one launch for
    the cases of ``test``, and no more."""
    seen = []
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module or getattr(item, "originalname", None) != test:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        value = params[names[0]] if len(names) == 1 else tuple(params[n] for n in names)
        if value not in seen:
            seen.append(value)
    return seen


def train_local(cfg, fault=None):
    """Train ``cfg`` with every node in this process (the single-process backend); the report.
    ``fault``: a plan of :mod:`faults` armed meanwhile (in one process, a ``nan@ROUND:NODE``)."""
    import faults
    from admm_dist.engine.dist import distributed
    from admm_dist.engine.env import read_env
    from admm_dist.training.trainer import Trainer

    with faults.armed(fault), distributed("cpu", env=read_env({})) as ctx:
        return Trainer(cfg, ctx).train()


def cli_rank(argv):
    """One rank of ``torchrun -m admm_dist.train ARGV`` (to run under
    :func:`admm_dist.bench.launcher.launch_cpu` with ``setup=False``, which is torchrun's agent
    without an interpreter start-up per rank): exits with the command's exit code, else returns
    the elastic attempt it finished in. The fault ``ADMM_DIST_FAULT_AT`` plans (:mod:`faults`) is
    armed in this rank first, as ``python -m tests.fault_train`` arms it."""
    import sys

    import faults
    from admm_dist.cli import train
    faults.install(faults.from_env())
    rc = train.main(argv)
    if rc:
        sys.exit(rc)
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def build_tiny(folder, n_agents: int) -> dict:
    """A tiny random Qwen3 backbone (built offline) and a synthetic DPO fit set of 16 examples
    per seat, in ``folder``: {"backbone", "fit", "n", "settings"}."""
    from transformers import AutoTokenizer

    from admm_dist.demo.synthetic import write_fitset
    from admm_dist.demo.tiny import save_tiny_backbone

    bb = save_tiny_backbone(str(Path(folder) / "backbone"), seed=1, hidden=32, layers=2, heads=2)
    settings = {"task": "synthetic", "n_agents": n_agents, "adapt_roles": "all"}
    fit = write_fitset(str(Path(folder) / "dpo.jsonl"), settings=settings, per_seat=16,
                       tokenizer=AutoTokenizer.from_pretrained(bb))
    return {"backbone": bb, "fit": fit, "n": n_agents, "settings": settings}


# the tiny run on those assets: seconds per round on one CPU core
TINY_RUN = dict(task="synthetic", device="cpu", lora_rank=4, lora_alpha=8.0, lora_layers_last=2,
                local_steps=2, batch_size=4, eta=0.02, rho=0.1, grad_clip=1.0)


def tiny_settings(assets: dict, **kw) -> dict:
    """The tiny run on ``assets`` as {key: value}, ``kw`` on top (out, report_dir, k_outer, ...)."""
    return {"model_name": assets["backbone"], "fitset_cache": assets["fit"], "n_agents": assets["n"],
            **TINY_RUN, **kw}


def tiny_args(assets: dict, **kw) -> List[str]:
    """The same as the training command's ``key=value`` overrides."""
    return [f"{k}={v}" for k, v in tiny_settings(assets, **kw).items()]


def train_cmd(args: Sequence[str], nproc: int = 1) -> List[str]:
    """``python -m admm_dist.train ARGS``, under ``torchrun --standalone`` when ``nproc`` > 1."""
    if nproc == 1:
        return [sys.executable, "-m", "admm_dist.train", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "admm_dist.train", *args]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """``tiny_assets(n_agents)``: :func:`build_tiny`'s assets, built once per chain length."""
    made = {}

    def build(n_agents: int) -> dict:
        if n_agents not in made:
            made[n_agents] = build_tiny(tmp_path_factory.mktemp(f"tiny{n_agents}"), n_agents)
        return made[n_agents]
    return build
