"""Seat groups on the shipped CPU config (configs/cpu/admm_ring.yaml: 4 seats, the tiny backbone
and fit set in assets/tiny): W = 8 ranks (k = 2 per seat), with and without shard_backbone, end
where one process ends, for every consensus mode; a run killed after round 2 at W = 8 resumes
at W = 4 and ends there too. Each run splits a local step's minibatch in micro_batches = 2
parts, the one setting every world size shares (docs/placement.md), and is shortened to 3 rounds
of 2 local steps (the config's 5 x 4 add nothing to what is compared, only time)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from admm_dist.core import config_file
from admm_dist.bench.launcher import launch_cpu
from admm_dist.training.config import TrainConfig

from conftest import REPO, train_local
from trainer_runs import _launch_cli, _train_worker

CONFIG = str(REPO / "configs" / "cpu" / "admm_ring.yaml")
SEATS = 4


def _args(out, **kw):
    tiny = REPO / "assets" / "tiny"
    d = dict(model_name=tiny / "backbone", fitset_cache=tiny / "fitset-dpo.jsonl", out=out / "run",
             report_dir=out / "reports", micro_batches=2, k_outer=3, local_steps=2, quiet=True, timeout_s=120,
             **kw)
    return [f"{k}={v}" for k, v in d.items()]


def _cfg(out, **kw) -> TrainConfig:
    return config_file.load(TrainConfig, ["--config", CONFIG, *_args(out, **kw)])


def _same_end(a: TrainConfig, b: TrainConfig, tol: float = 0.0) -> None:
    """Every node file's x, z, u and the -last vector of ``a`` are ``b``'s (bit for bit at tol 0)."""
    for path in [f"node-{i}.safetensors" for i in range(SEATS)]:
        x, y = load_file(os.path.join(a.out, path)), load_file(os.path.join(b.out, path))
        for key in ("x", "z", "u"):
            assert float((x[key] - y[key]).norm()) <= tol * float(y[key].norm()), (a.out, path, key)
            assert tol or torch.equal(x[key], y[key]), (a.out, path, key)
    last_a, last_b = load_file(a.out + "-last.safetensors")["b"], load_file(b.out + "-last.safetensors")["b"]
    assert float((last_a - last_b).norm()) <= tol * float(last_b.norm()) and (tol or torch.equal(last_a, last_b))


@pytest.mark.slow
@pytest.mark.parametrize("consensus,shards", [("ring", (False, True)), ("coordinator", (True,)),
                                              ("gossip", (False,)), ("decentralized", (True,))],
                         ids=["ring-whole-sharded", "coordinator-sharded", "gossip-whole", "decentralized-sharded"])
def test_the_cpu_config_on_eight_ranks_equals_one_process(consensus, shards, tmp_path):
    """W = 8 (k = 2): one process's bits (coordinator within 1e-6 relative: its all_reduce sums
    in another order). The ring runs whole and sharded; the other modes one of the two each,
    alternating (the backbone's placement is below the consensus mode, which sees only the
    leaders' group, so each pairing is covered once without running all eight)."""
    one = _cfg(tmp_path / "w1", consensus=consensus)
    train_local(one)
    for shard in shards:
        eight = _cfg(tmp_path / f"w8-{'shard' if shard else 'whole'}", consensus=consensus, shard_backbone=shard)
        launch_cpu(_train_worker, 2 * SEATS, eight, timeout_s=300)
        _same_end(eight, one, tol=1e-6 if consensus == "coordinator" else 0.0)


@pytest.mark.slow
def test_a_run_killed_after_round_two_at_eight_ranks_resumes_at_four_bit_for_bit(tmp_path, monkeypatch):
    """The ranks of seat 1 exit right after round 2's checkpoint at W = 8 (sharded backbone);
    resume=auto at W = 4 ends where one uninterrupted process ends."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    clean = _cfg(tmp_path / "clean")
    train_local(clean)
    args = _args(tmp_path / "moved", shard_backbone=True)
    with pytest.raises(ChildFailedError):
        _launch_cli(["--config", CONFIG, *args], 2 * SEATS, monkeypatch, fault="2:1")
    assert (tmp_path / "moved" / "run.ckpt").is_dir() and not (tmp_path / "moved" / "run-last.safetensors").exists()
    _launch_cli(["--config", CONFIG, *args, "resume=auto"], SEATS, monkeypatch)
    report = json.loads((tmp_path / "moved" / "reports" / "run-train.json").read_text())
    assert report["resumed"]["after_round"] == 2 and len(report["rounds"]) == clean.k_outer
    _same_end(_cfg(tmp_path / "moved"), clean)
