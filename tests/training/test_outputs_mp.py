"""Outputs under several ranks (real gloo process groups, the training command on each rank):
checkpoints are pruned only once every rank holds a later complete round, and the final
writes are all ranks' or none."""
import os

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from admm_dist.bench.launcher import launch_cpu
import faults

from conftest import cli_rank, tiny_args

N = 2


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(N)


def _args(assets, tmp, **kw):
    return tiny_args(assets, **dict(dict(k_outer=3, timeout_s=30, quiet=True, out=str(tmp / "runs" / "run"),
                                         report_dir=str(tmp / "reports")), **kw))


def _launch(args, monkeypatch, restarts=0, fault=None):
    monkeypatch.delenv(faults.ENV, raising=False)
    if fault:
        monkeypatch.setenv(faults.ENV, fault)
    return launch_cpu(cli_rank, N, args, timeout_s=90, max_restarts=restarts, setup=False)


def _last(tmp):
    return load_file(str(tmp / "runs" / "run-last.safetensors"))["b"]


@pytest.fixture(scope="module")
def clean(assets, tmp_path_factory):
    """The uninterrupted run's final z: the command in this process, every node on one backbone
    (the numbers do not depend on the placement: tests/training/test_trainer.py)."""
    from admm_dist.cli import train

    tmp = tmp_path_factory.mktemp("clean")
    assert train.main(_args(assets, tmp, keep_checkpoints=1)) == 0
    return _last(tmp)


@pytest.mark.parametrize("point", ["json-renaming", pytest.param("tensors-renaming", marks=pytest.mark.slow)])
def test_a_rank_killed_inside_a_checkpoint_write_never_loses_the_last_common_round(assets, clean, tmp_path,
                                                                                  monkeypatch, point):
    """keep_checkpoints=1, node 1's rank SIGKILLed inside its round-2 write: rank 0 has written
    round 2 but must not prune round 1, the last round both completed; the elastic restart
    resumes from it and ends bit for bit where an uninterrupted run ends."""
    hurt = tmp_path / "hurt"
    got = _launch(_args(assets, hurt, keep_checkpoints=1, resume="auto"), monkeypatch, restarts=1,
                  fault=f"ckpt@2:1:{point}")
    assert got == {0: 1, 1: 1}                                  # the kill fired; attempt 1 finished
    assert torch.equal(clean, _last(hurt))
    assert os.listdir(hurt / "runs" / "run.ckpt") == ["round-000003"]
    leftovers = [f for d, _, fs in os.walk(hurt / "runs") for f in fs if f.startswith(".")]
    assert leftovers == []


def test_no_rank_finishes_alone_when_another_cannot_write_its_results(assets, tmp_path, monkeypatch, capfd):
    from admm_dist.cli import train

    # a finished run's results (written in this process: a node's files do not depend on its rank)
    assert train.main(_args(assets, tmp_path, k_outer=2)) == 0
    out = tmp_path / "runs" / "run"
    files = [out / "node-0.safetensors", tmp_path / "runs" / "run-last.safetensors",
             tmp_path / "reports" / "run-train.json", out / "seat_map.json"]
    before = {p: p.read_bytes() for p in files}
    os.unlink(out / "node-1.safetensors")
    os.mkdir(out / "node-1.safetensors")                      # in the way of rank 1's result
    capfd.readouterr()
    with pytest.raises(ChildFailedError):
        _launch(_args(assets, tmp_path, k_outer=3, resume="auto"), monkeypatch)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("admm_dist.train: error")]
    assert any(f"error on rank 1: cannot use {out}/node-1.safetensors" in line for line in lines), err[-3000:]
    assert any("error on rank 0: a peer rank could not write its results" in line
               and "nothing in out= was replaced" in line for line in lines), err[-3000:]
    assert {p: p.read_bytes() for p in files} == before         # nothing replaced, no new -last
    assert "done:" not in err
    leftovers = [f for d, _, fs in os.walk(tmp_path / "runs") for f in fs if f.startswith(".")]
    assert leftovers == []
    os.rmdir(out / "node-1.safetensors")                      # fixed: the run finishes from its checkpoint
    assert _launch(_args(assets, tmp_path, k_outer=3, resume="auto"), monkeypatch) == {0: 0, 1: 0}
    meta = load_file(str(out / "node-1.safetensors"))
    assert set(meta) == {"x", "z", "u"}
