"""The trainer end to end on a tiny random Qwen3 (built offline) with real PEFT adapters.

Distributed runs use 3 gloo ranks (one per seat); each is compared with the
single-process backend, which simulates the same nodes in one process.
"""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from admm_dist.core.errors import UserError
from admm_dist.bench.launcher import launch_cpu
from admm_dist.demo.synthetic import write_fitset
from admm_dist.demo.tiny import save_tiny_backbone
from admm_dist.training.trainer import Trainer

from conftest import selected, train_local
from trainer_runs import N, _args, _cfg, _launch_cli, _train_many, assets  # noqa: F401 (fixture)


ARMS = {
    "ring": dict(consensus="ring"),
    "coordinator": dict(consensus="coordinator"),
    "gossip": dict(consensus="gossip", topology="chain"),
    "decentralized": dict(consensus="decentralized", topology="chain"),
    "ring_int8": dict(consensus="ring", compress="int8"),
    "ring_int4": dict(consensus="ring", compress="int4"),
    "no_dual": dict(no_dual=True),
    "local_only": dict(local_only=True),
    "centralized": dict(pooled=True, consensus="coordinator"),
    "ring_rho_adapt": dict(consensus="ring", rho_adapt=True, rho=1e-4),
}


# ring, coordinator and gossip are checked on W = 2 below (test_fewer_ranks_than_nodes_...)
# and on W = N in tests/engine/test_admm_mp.py (ring also as ring_rho_adapt here), the
# ablations there too; ring_int4 trains as ring_int8 does (the trainer's compressed path), and
# its int4 consensus is the oracle's bit for bit on any number of ranks in
# tests/engine/test_compressed_mp.py: slow here
SLOW_ARMS = ("ring", "coordinator", "gossip", "no_dual", "local_only", "ring_int4")


@pytest.fixture(scope="module")
def arm_runs(assets, tmp_path_factory, request):
    """{arm: its distributed run's config}, for every arm this session runs
    test_distributed_arm_equals_single_process with: the arms of N nodes trained one after
    the other in ONE launch of N gloo ranks (the ranks' start-up paid once, not once an arm),
    the centralized arm (one node) in a world of one under the launcher."""
    tmp = tmp_path_factory.mktemp("arms")
    cfgs = {arm: _cfg(assets, tmp / arm / "dist", **ARMS[arm])
            for arm in selected(request, "test_distributed_arm_equals_single_process", "arm")}
    for nproc in (N, 1):
        todo = [cfg for arm, cfg in cfgs.items() if (1 if ARMS[arm].get("pooled") else N) == nproc]
        if todo:
            launch_cpu(_train_many, nproc, todo, timeout_s=120)
    return cfgs


@pytest.mark.parametrize("arm", [pytest.param(a, marks=pytest.mark.slow) if a in SLOW_ARMS else a
                                 for a in sorted(ARMS)])
def test_distributed_arm_equals_single_process(arm, assets, arm_runs, tmp_path):
    kw = ARMS[arm]
    dist_cfg = arm_runs[arm]      # trained on N ranks (the centralized arm: one) by the fixture
    local_cfg = _cfg(assets, tmp_path / "local", **kw)
    report = train_local(local_cfg)
    key = "x" if arm == "local_only" else "z"
    nodes = 1 if kw.get("pooled") else N
    for i in range(nodes):
        a = load_file(os.path.join(dist_cfg.out, f"node-{i}.safetensors"))[key]
        b = load_file(os.path.join(local_cfg.out, f"node-{i}.safetensors"))[key]
        assert a.norm() > 0
        assert float((a - b).norm() / b.norm()) <= 1e-5, (arm, i)
    rep = json.loads((Path(dist_cfg.report_dir) / "run-train.json").read_text())
    assert len(rep["rounds"]) == 3 and len(rep["rounds"][0]["f"]) == nodes
    for field in ("f", "primal", "primal_normalized", "dual", "bytes_sent", "bytes_recv",
                  "sec_x", "sec_z", "sec_other"):
        assert len(rep["rounds"][-1][field]) == nodes
    if kw.get("rho_adapt"):   # every rank changed rho in the same rounds, and the oracle too
        rhos = [r["rho"] for r in rep["rounds"]]
        assert rhos[0] == 1e-4 and rhos[-1] > 1e-4 and rhos == [r["rho"] for r in report["rounds"]]
    if arm == "local_only":
        assert not os.path.exists(dist_cfg.out + "-last.safetensors")
        assert all(b == 0 for r in rep["rounds"] for b in r["bytes_sent"])
    else:
        assert os.path.exists(dist_cfg.out + "-last.safetensors")
    assert report["delta_w_rel"]


def test_dpo_loss_falls_and_the_exported_peft_adapter_reproduces_logits(assets, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = _cfg(assets, tmp_path, k_outer=5, local_steps=4, eta=0.02, export_peft=True,
               dev_frac=0.25)
    report = train_local(cfg)
    f = report["loss_curve"]
    assert f[0][0] < 0.6932 + 1e-3  # starts at about log 2 (B = 0) and can only have fallen
    assert sum(f[-1]) < 0.8 * sum(f[0])
    assert os.path.exists(cfg.out + "-best.safetensors") and report["best"]["round"] >= 1
    # the exported folder is a standard PEFT adapter with the consensus z
    base = AutoModelForCausalLM.from_pretrained(assets["backbone"])
    ids = torch.tensor([[5, 9, 17, 33, 2, 40, 41]])
    peft = PeftModel.from_pretrained(base, cfg.out + "-last-peft").eval()
    from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
    from admm_dist.model.vectors import load_vector

    ad = BOnlyLoRA(AutoModelForCausalLM.from_pretrained(assets["backbone"]),
                   AdapterConfig(lora_rank=4, lora_alpha=8.0, lora_layers_last=2, lora_basis_seed=42))
    vec, _ = load_vector(cfg.out + "-last.safetensors", ad)
    ad.load_vector(vec)
    with torch.no_grad():
        assert torch.allclose(peft(ids).logits, ad.model.eval()(ids).logits, atol=1e-5)


# a killed rank's elastic restart resuming bit for bit is the default suite's in
# tests/training/test_outputs_mp.py (test_a_rank_killed_inside_a_checkpoint_write_..., 2 ranks,
# killed in the middle of a checkpoint write); this one (3 ranks, a plain kill) is the slow suite's
@pytest.mark.slow
def test_killed_rank_resumes_bit_for_bit(assets, tmp_path, monkeypatch):
    from admm_dist.cli import train

    # the run never killed: the command in this process, every node on one backbone (the numbers
    # do not depend on the placement: test_fewer_ranks_than_nodes_... and the arms above)
    assert train.main(_args(assets, tmp_path / "clean")) == 0
    hurt = _launch_cli(_args(assets, tmp_path / "hurt", resume="auto"), N, monkeypatch, restarts=1, fault="2:1")
    # the fault really fired: every rank finished in the restarted attempt
    assert hurt == {r: 1 for r in range(N)}
    a = load_file(str(tmp_path / "clean" / "run-last.safetensors"))["b"]
    b = load_file(str(tmp_path / "hurt" / "run-last.safetensors"))["b"]
    assert torch.equal(a, b)
    # only the last few checkpoints are kept
    rounds = sorted(os.listdir(tmp_path / "hurt" / "run.ckpt"))
    assert rounds == ["round-000002", "round-000003", "round-000004"]


def test_non_finite_loss_stops_every_rank_with_round_and_node(assets, tmp_path, monkeypatch, capfd):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with pytest.raises(ChildFailedError):
        _launch_cli(_args(assets, tmp_path), N, monkeypatch, fault="nan@2:1")
    errs = [l for l in capfd.readouterr().err.splitlines() if "admm_dist.train: error" in l]
    # every rank that got to report names the same round and node (the agent may stop
    # the others with SIGTERM first); none went past that round or wrote an output
    assert errs and all("round 2" in l and "[1]" in l for l in errs), errs
    assert sorted(os.listdir(tmp_path / "run.ckpt")) == ["round-000001"]
    assert not os.path.exists(tmp_path / "run-last.safetensors")
    assert not os.path.exists(tmp_path / "run")


def test_bad_fitsets_and_checkpoints_are_one_clear_line(assets, tmp_path):
    from admm_dist.cli import train

    def run(**kw):
        out = tmp_path / "x"
        argv = _args(assets, out, **kw)
        return train.main(argv), out

    # missing file
    rc, out = run(fitset_cache=str(tmp_path / "missing.jsonl"))
    assert rc == 2 and not os.path.exists(str(out / "run-last.safetensors"))
    # corrupt file
    bad = tmp_path / "corrupt.jsonl"
    bad.write_text('{"format": "admm_dist.fitset", "version": 1\n{not json')
    assert run(fitset_cache=str(bad))[0] == 2
    # built under other settings
    other = write_fitset(str(tmp_path / "other.jsonl"), per_seat=16,
                         settings=dict(assets["settings"], n_agents=4))
    assert run(fitset_cache=other)[0] == 2
    # a checkpoint from another configuration
    rc, out = run(k_outer=2)
    assert rc == 0
    rc, _ = run(k_outer=3, resume="auto", rho=0.5)
    assert rc == 2


def test_bad_input_messages(assets, tmp_path, capsys):
    from admm_dist.cli import train

    train.main(_args(assets, tmp_path, fitset_cache=str(tmp_path / "missing.jsonl")))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
    other = write_fitset(str(tmp_path / "other.jsonl"), per_seat=16,
                         settings=dict(assets["settings"], n_agents=4))
    train.main(_args(assets, tmp_path, fitset_cache=other))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "n_agents" in err[0]
    train.main(_args(assets, tmp_path, k_outer=1))
    capsys.readouterr()
    train.main(_args(assets, tmp_path, k_outer=2, resume="auto", rho=0.5))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another run" in err[0] and "resume with that run's settings" in err[0]


def test_an_adapter_that_did_not_move_is_not_written(assets, tmp_path, capsys):
    from admm_dist.cli import train

    rc = train.main(_args(assets, tmp_path, eta=1e-13, k_outer=1, local_steps=1))
    err = [l for l in capsys.readouterr().err.splitlines() if "error" in l]
    assert rc == 2 and "did not move" in err[0]
    assert not os.path.exists(tmp_path / "run-last.safetensors")
    rep = json.loads((tmp_path / "reports" / "run-train-refused.json").read_text())   # beside, not over
    assert rep["delta_w_rel"] < 1e-6 and not os.path.exists(tmp_path / "reports" / "run-train.json")


def test_a_refused_result_is_its_own_error_the_benchmark_can_tell_apart(assets, tmp_path):
    """The learning benchmark counts a refused arm as a result; any other bad setting stops it."""
    from benchmarks.fidelity_run import train_arm
    from admm_dist.training.outputs import RefusedError

    with pytest.raises(RefusedError, match="did not move"):
        train_local(_cfg(assets, tmp_path / "a", eta=1e-13, k_outer=1, local_steps=1))
    assert "did not move" in train_arm(_cfg(assets, tmp_path / "b", eta=1e-13, k_outer=1, local_steps=1))["refused"]
    with pytest.raises(UserError, match="does not exist"):   # not a refusal: it stops the benchmark
        train_arm(_cfg(assets, tmp_path / "c", fitset_cache=str(tmp_path / "missing.jsonl")))


def test_dry_run_and_anchor_partition(assets, tmp_path):
    cfg = _cfg(assets, tmp_path, dry_run=True, partition="anchor", n_partitions=2,
               no_grad_checkpointing=True)
    report = train_local(cfg)
    # every example lands on exactly one of the two anchor partitions
    assert len(report["node_sizes"]) == 2 and sum(report["node_sizes"]) == 3 * 16
    assert report["n_nodes"] == 2 and min(report["node_sizes"]) >= 16
    assert os.path.exists(tmp_path / "reports" / "run-train-dryrun.json")  # beside, never over, a result
    assert not os.path.exists(cfg.out + "-last.safetensors")
    with pytest.raises(Exception, match="fewer than 16"):
        train_local(_cfg(assets, tmp_path, dry_run=True, partition="anchor", n_partitions=4))


def test_warm_start_with_the_collection_policy_as_kl_reference(assets, tmp_path):
    import math

    first = train_local(_cfg(assets, tmp_path / "a", k_outer=2, local_steps=2))
    warm = _cfg(assets, tmp_path / "b", k_outer=1, local_steps=1,
                init_state=str(tmp_path / "a" / "run-last.safetensors"))
    # reference = the warm-start adapter: the first step's policy equals it (loss log 2, KL 0)
    f_collect = train_local(dataclass_replace(warm, kl_ref="collect"))["loss_curve"][0]
    assert all(abs(v - math.log(2)) < 1e-5 for v in f_collect), f_collect
    # reference = the backbone without adapters: the warm start already prefers chosen
    f_frozen = train_local(dataclass_replace(warm, kl_ref="frozen", out=str(tmp_path / "c" / "run"),
                                             report_dir=str(tmp_path / "c" / "reports")))["loss_curve"][0]
    assert all(v < math.log(2) - 0.05 for v in f_frozen), f_frozen
    assert first["delta_w_rel"] > 0


def dataclass_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def _basis_worker(ctx, cfg):
    import dataclasses

    from admm_dist.model.adapter import AdapterError

    cfg = dataclasses.replace(cfg, lora_basis_seed=7 if ctx.rank == 2 else 42)
    try:
        Trainer(cfg, ctx).setup()
    except AdapterError as e:
        return str(e)
    return ""


def test_ranks_with_different_lora_bases_refuse_to_start(assets, tmp_path):
    res = launch_cpu(_basis_worker, N, _cfg(assets, tmp_path), timeout_s=60)
    assert all("differs across ranks" in res[r] and "[2]" in res[r] for r in range(N)), res


@pytest.mark.parametrize("fit_mode", ["sft", "rsft", "dpo"])
def test_sft_rsft_and_derived_dpo_from_an_sft_fit_set(assets, tmp_path, fit_mode):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["backbone"])
    sft = write_fitset(str(tmp_path / "sft.jsonl"), fit_mode="sft", per_seat=16,
                       settings=assets["settings"], tokenizer=tok)
    report = train_local(_cfg(assets, tmp_path, fitset_cache=sft, fit_mode=fit_mode, k_outer=3,
                         local_steps=3))
    # rsft keeps the successful half of the rollouts; dpo pairs them with the failed half
    assert report["node_sizes"] == [32 if fit_mode == "sft" else 16] * N
    f = report["loss_curve"]
    assert sum(f[-1]) < sum(f[0])


def test_local_only_with_an_empty_seat_writes_the_seats_that_moved(assets, tmp_path):
    """A seat with no examples has nothing to learn under local_only (f_i = 0, no coupling):
    its x_i stays at x^0, and only the seats that had examples are required to move."""
    from admm_dist.data import fitset as fs

    f = fs.load_fitset(assets["fit"])
    keep = [e for e in f.examples if e.seat != 2]
    path = str(tmp_path / "no_seat2.jsonl")
    fs.save_fitset(path, keep, fit_mode=f.fit_mode, settings=f.settings, stats=f.stats,
                   anchor_keys=f.anchor_keys)
    cfg = _cfg(assets, tmp_path, fitset_cache=path, local_only=True, empty_nodes="prox")
    report = train_local(cfg)
    dw = report["delta_w_rel"]
    assert report["node_sizes"][2] == 0 and dw[2] == 0.0 and dw[0] > 1e-6 and dw[1] > 1e-6
    x2 = load_file(str(tmp_path / "run" / "node-2.safetensors"))["x"]
    assert torch.count_nonzero(x2) == 0
    # a coupled run with the same empty seat still moves it (it follows the consensus); its
    # round lines show its f as "-", not a measured 0.0, after one note saying why
    from admm_dist.engine.dist import distributed
    from admm_dist.engine.env import read_env

    lines = []
    with distributed("cpu", env=read_env({})) as ctx:
        report = Trainer(_cfg(assets, tmp_path / "coupled", fitset_cache=path, empty_nodes="prox", quiet=False),
                         ctx, log=lines.append).train()
    assert report["delta_w_rel"] > 1e-6
    assert [m for m in lines if "node(s) 2 have none, so f_i = 0 (shown as f=-)" in m], lines
    rounds = [m for m in lines if m.startswith("round ")]
    assert rounds and all(m.split("f=[")[1].split("]")[0].split(", ")[2] == "-" for m in rounds), rounds


def test_an_example_longer_than_the_backbone_positions_names_the_lengths(assets, tmp_path, capsys):
    from admm_dist.cli import train

    short = save_tiny_backbone(str(tmp_path / "short"), seed=1, hidden=32, layers=2, heads=2, max_positions=24)
    capsys.readouterr()
    assert train.main(_args(assets, tmp_path, model_name=short)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 24 positions (max_position_embeddings): lower max_prompt_tokens" in err[0]
    assert train.main(_args(assets, tmp_path / "ok", model_name=short, max_prompt_tokens=8,
                            max_target_tokens=8)) == 0
