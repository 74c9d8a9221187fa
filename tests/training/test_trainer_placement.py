"""Placement: N nodes on any W <= N gloo ranks train the single-process oracle's nodes (contiguous
blocks per rank), a run resumes onto another world size bit for bit, and more ranks than nodes
are refused naming the fix."""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from admm_dist.bench.launcher import launch_cpu

from conftest import selected, train_local
from trainer_runs import (N, _args, _cfg, _launch_cli, _train_many, _train_worker,  # noqa: F401
                         assets)   # assets: the module's fixture


def test_a_world_that_is_neither_at_most_n_nor_k_times_n_is_refused(assets, tmp_path, monkeypatch, capfd):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with pytest.raises(ChildFailedError):
        _launch_cli(_args(assets, tmp_path), N + 1, monkeypatch)
    errs = [l for l in capfd.readouterr().err.splitlines() if "admm_dist.train: error" in l]
    assert errs and all(f"world size {N + 1} for {N} seats: launch {N} or {2 * N} ranks" in l for l in errs), errs
    assert not os.path.exists(tmp_path / "run-last.safetensors")


def _w2_kw(consensus, dtype):
    kw = dict(consensus=consensus, topology="chain") if consensus == "gossip" else dict(consensus=consensus)
    return dict(kw, dtype=dtype)


@pytest.fixture(scope="module")
def w2_runs(assets, tmp_path_factory, request):
    """{(consensus, dtype): its run's config on W = 2 ranks}, for every case this session runs
    test_fewer_ranks_than_nodes_train_the_oracles_nodes with, trained one after the other in
    ONE launch of 2 gloo ranks (their start-up paid once, not once a case)."""
    tmp = tmp_path_factory.mktemp("w2")
    cases = selected(request, "test_fewer_ranks_than_nodes_train_the_oracles_nodes", "consensus", "dtype")
    cfgs = {case: _cfg(assets, tmp / "-".join(case) / "dist", **_w2_kw(*case)) for case in cases}
    if cfgs:
        launch_cpu(_train_many, 2, list(cfgs.values()), timeout_s=120)
    return cfgs


@pytest.mark.parametrize("consensus,dtype", [("ring", "auto"), ("gossip", "auto"), ("coordinator", "auto"),
                                             ("ring", "bfloat16")])
def test_fewer_ranks_than_nodes_train_the_oracles_nodes(consensus, dtype, assets, w2_runs, tmp_path):
    """N = 3 nodes on W = 2 ranks (nodes 0, 1 on rank 0; node 2 on rank 1): every node file
    equals the single-process run's, bit for bit for ring and gossip; a bfloat16 backbone on
    CPU too (its LoRA path and the consensus stay float32). The fixture trained the W = 2 runs."""
    kw = _w2_kw(consensus, dtype)
    dist_cfg = w2_runs[(consensus, dtype)]
    local_cfg = _cfg(assets, tmp_path / "local", **kw)
    train_local(local_cfg)
    for i in range(N):
        a = load_file(os.path.join(dist_cfg.out, f"node-{i}.safetensors"))
        b = load_file(os.path.join(local_cfg.out, f"node-{i}.safetensors"))
        for key in ("x", "z", "u"):
            if consensus == "coordinator":
                assert float((a[key] - b[key]).norm() / b[key].norm().clamp_min(1e-30)) <= 1e-5, (i, key)
            else:
                assert torch.equal(a[key], b[key]), (consensus, i, key)
    rep = json.loads((Path(dist_cfg.report_dir) / "run-train.json").read_text())
    assert rep["n_nodes"] == N and len(rep["rounds"][-1]["f"]) == N
    if dtype == "bfloat16":   # the backbone held half a float32 one's bytes, and trained otherwise
        fp32 = train_local(_cfg(assets, tmp_path / "fp32", **dict(kw, dtype="float32")))
        assert 2 * rep["memory"]["backbone_bytes"][0] == fp32["memory"]["backbone_bytes"][0]
        assert fp32["loss_curve"] != rep["loss_curve"]
    assert rep["placement"] == [[0, 1], [2]] and rep["backend"] == "ProcessGroupCommunicator"
    last = rep["rounds"][-1]
    if consensus != "coordinator":   # node 0 hands node 1 its part in memory; node 1 sends to node 2
        assert last["bytes_in_process"][0] > 0 and last["bytes_sent"][1] > 0


@pytest.mark.parametrize("consensus,shard", [("ring", True)])
def test_two_ranks_per_seat_train_the_oracles_nodes(consensus, shard, assets, tmp_path):
    """N = 3 seats on W = 6 ranks (k = 2: each seat's minibatch in 2 parts, one per rank of its
    seat group; the leaders carry the consensus; with ``shard_backbone`` each rank holds half
    of the frozen backbone): every node file and -last equal the single-process run's with the
    same micro_batches, bit for bit (coordinator to round-off); only the leaders write, and the
    report records the placement. Every mode, whole and sharded, on 4 seats and 8 ranks:
    tests/training/test_trainer_seat_groups.py (slow)."""
    kw = dict(consensus=consensus, micro_batches=2, **(dict(topology="chain") if consensus == "gossip" else {}))
    dist_cfg = _cfg(assets, tmp_path / "dist", shard_backbone=shard, **kw)
    local_cfg = _cfg(assets, tmp_path / "local", **kw)
    launch_cpu(_train_worker, 2 * N, dist_cfg, timeout_s=240)
    train_local(local_cfg)
    tol = 1e-5 if consensus == "coordinator" else 0.0
    for path in [f"node-{i}.safetensors" for i in range(N)]:
        a, b = load_file(os.path.join(dist_cfg.out, path)), load_file(os.path.join(local_cfg.out, path))
        for key in ("x", "z", "u"):
            assert float((a[key] - b[key]).norm()) <= tol * float(b[key].norm()), (consensus, path, key)
    assert float((load_file(dist_cfg.out + "-last.safetensors")["b"]
                  - load_file(local_cfg.out + "-last.safetensors")["b"]).norm()) <= tol
    rep = json.loads((tmp_path / "dist" / "reports" / "run-train.json").read_text())
    assert rep["placement"] == [[0], [0], [1], [1], [2], [2]] and len(rep["rounds"][-1]["f"]) == N
    local = json.loads((tmp_path / "local" / "reports" / "run-train.json").read_text())["memory"]
    whole = local["backbone_bytes"][0]
    held = rep["memory"]["backbone_bytes"]
    assert rep["memory"]["adapter_bytes"] == local["adapter_bytes"] * 2 * N    # LoRA whole on every rank
    print("param bytes held per rank", held, "of", whole)
    assert len(held) == 2 * N and all(h < 0.75 * whole if shard else h == whole for h in held)
    wire, seat = rep["bytes_per_rank"]["consensus"], rep["bytes_per_rank"]["seat_group"]   # the leaders carry
    assert all(s > 0 for s in wire["sent"][::2]) and not any(wire["sent"][1::2])           # the consensus and
    assert all(s > 0 for s in seat["sent"][::2]) and all(r > 0 for r in seat["recv"][1::2])   # give z to the rest
    assert sum(wire["sent"]) == sum(sum(r["bytes_sent"]) for r in rep["rounds"])


@pytest.mark.slow
@pytest.mark.parametrize("consensus", ["ring", "gossip"])
def test_four_nodes_on_any_number_of_ranks_equal_one_process(consensus, tiny_assets, tmp_path):
    """N = 4 nodes on W = 2, 3, 4 ranks: the final z and every node file are the single-process
    run's (W = 1), bit for bit (one reference run for the three)."""
    four = tiny_assets(4)
    kw = dict(n_agents=4, consensus=consensus, **(dict(topology="ring") if consensus == "gossip" else {}))
    local_cfg = _cfg(four, tmp_path / "local", **kw)
    train_local(local_cfg)
    for world in (2, 3, 4):
        dist_cfg = _cfg(four, tmp_path / f"w{world}", **kw)
        launch_cpu(_train_worker, world, dist_cfg, timeout_s=180)
        assert torch.equal(load_file(dist_cfg.out + "-last.safetensors")["b"],
                           load_file(local_cfg.out + "-last.safetensors")["b"]), (consensus, world)
        for i in range(4):
            a = load_file(os.path.join(dist_cfg.out, f"node-{i}.safetensors"))
            b = load_file(os.path.join(local_cfg.out, f"node-{i}.safetensors"))
            assert all(torch.equal(a[k], b[k]) for k in ("x", "z", "u")), (consensus, world, i)


@pytest.mark.parametrize("consensus,compress", [pytest.param("ring", "none", marks=pytest.mark.slow),
                                               pytest.param("gossip", "none", marks=pytest.mark.slow),
                                               ("decentralized", "int8")])   # the one with per-node comm state
def test_a_run_resumes_onto_another_world_size_bit_for_bit(consensus, compress, tiny_assets, tmp_path):
    """Checkpoints are per node (the public copies of compressed consensus too): N = 4 nodes, 2
    rounds on 4 ranks, then resume=auto on 2 ranks, then on 3 (blocks 2, 1, 1), ends where one
    uninterrupted single-process run ends, bit for bit."""
    import dataclasses

    four = tiny_assets(4)
    kw = dict(n_agents=4, consensus=consensus, compress=compress,
              **(dict(topology="chain") if consensus != "ring" else {}))
    clean = _cfg(four, tmp_path / "clean", k_outer=4, **kw)
    train_local(clean)
    moved = _cfg(four, tmp_path / "moved", k_outer=2, **kw)
    launch_cpu(_train_worker, 4, moved, timeout_s=120)
    launch_cpu(_train_worker, 2, dataclasses.replace(moved, k_outer=3, resume="auto"), timeout_s=120)
    launch_cpu(_train_worker, 3, dataclasses.replace(moved, k_outer=4, resume="auto"), timeout_s=120)
    report = json.loads((tmp_path / "moved" / "reports" / "run-train.json").read_text())
    assert report["resumed"]["after_round"] == 3 and len(report["rounds"]) == 4
    assert report["placement"] == [[0, 1], [2], [3]]
    assert torch.equal(load_file(clean.out + "-last.safetensors")["b"],
                       load_file(moved.out + "-last.safetensors")["b"])
    for i in range(4):
        a = load_file(os.path.join(clean.out, f"node-{i}.safetensors"))
        b = load_file(os.path.join(moved.out, f"node-{i}.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in ("x", "z", "u")), (consensus, i)


@pytest.mark.slow
def test_a_run_at_two_ranks_per_seat_resumes_at_one_and_at_one_process_bit_for_bit(assets, tmp_path):
    """N = 3 seats: 2 rounds on W = 6 (k = 2; the leaders write the checkpoints), then resume=auto
    on W = 3 (k = 1), then in one process: the end is one uninterrupted single-process run's."""
    import dataclasses

    kw = dict(micro_batches=2, k_outer=4, checkpoint_every=1)
    clean = _cfg(assets, tmp_path / "clean", **kw)
    train_local(clean)
    moved = _cfg(assets, tmp_path / "moved", **dict(kw, k_outer=2))
    launch_cpu(_train_worker, 2 * N, moved, timeout_s=240)
    launch_cpu(_train_worker, N, dataclasses.replace(moved, k_outer=3, resume="auto"), timeout_s=120)
    train_local(dataclasses.replace(moved, k_outer=4, resume="auto"))
    report = json.loads((tmp_path / "moved" / "reports" / "run-train.json").read_text())
    assert report["resumed"]["after_round"] == 3 and len(report["rounds"]) == 4
    assert torch.equal(load_file(clean.out + "-last.safetensors")["b"],
                       load_file(moved.out + "-last.safetensors")["b"])
    for i in range(N):
        a = load_file(os.path.join(clean.out, f"node-{i}.safetensors"))
        b = load_file(os.path.join(moved.out, f"node-{i}.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in ("x", "z", "u")), i
