"""The rehearsal of a job (admm_dist/training/rehearsal.py, ``python -m admm_dist.plan``): what it
predicts on fake tensors in a fake world is what a real run holds, counted the same way (every
storage from birth to free), per category and at its peak: in one process, and on real gloo
ranks with two ranks per seat and the backbone sharded over them. The command refuses what the
trainer refuses, in one line, and a job that does not fit gets a change that does, rehearsed."""
import json

import pytest

from admm_dist.bench.launcher import launch_cpu
from admm_dist.cli import plan as plan_command
from admm_dist.core import config_file
from admm_dist.engine.dist import distributed
from admm_dist.engine.env import read_env
from admm_dist.training.config import TrainConfig
from admm_dist.training.rehearsal import CATEGORIES, rehearse
from benchmarks.calibration import RealRank

from conftest import REPO

# the tiny backbone's CPU run, its examples cut to a prompt of 48 tokens and a target of 16
TINY = ["--config", str(REPO / "configs" / "cpu" / "admm_ring.yaml"), "max_prompt_tokens=48",
        "max_target_tokens=16"]
SEAT_GROUPS = TINY + ["n_agents=2", "micro_batches=2", "shard_backbone=true"]   # N = 2 on 4 ranks: k = 2


def _measure(ctx, argv):
    """A real rank (the tiny backbone's weights, gloo) counted as the rehearsal counts."""
    rank = RealRank(ctx, argv)
    return rank.round(rank.load())


def _close(plan, measured):
    memory, peak, sent = measured
    for c in memory:
        assert abs(plan.memory[c] - memory[c]) <= 0.10 * max(memory[c], 1), (c, plan.memory[c], memory[c])
    assert abs(plan.peak - peak) <= 0.10 * peak, (plan.peak, peak)
    assert plan.sent == sent


def test_one_process_holds_what_its_rehearsal_says_per_category_and_at_its_peak():
    cfg = config_file.load(TrainConfig, TINY)
    plan = rehearse(cfg, 1, 0, device="cpu")
    with distributed("cpu", env=read_env({})) as ctx:
        measured = _measure(ctx, TINY)
    assert set(plan.memory) == set(CATEGORIES) and plan.kind == "seat" and plan.memory["kv_cache"] == 0
    assert plan.memory["activations"] > plan.memory["backbone"] > 0 and plan.memory["adam"] > 0
    _close(plan, measured)


def test_a_seat_groups_leader_and_follower_hold_what_their_rehearsals_say_with_the_backbone_sharded():
    cfg = config_file.load(TrainConfig, SEAT_GROUPS)
    res = launch_cpu(_measure, 4, SEAT_GROUPS, timeout_s=120)
    whole = rehearse(config_file.load(TrainConfig, TINY + ["n_agents=2", "micro_batches=2"]), 4, 0, device="cpu")
    for rank in (0, 1):   # the others are the same two kinds
        plan = rehearse(cfg, 4, rank, device="cpu")
        assert plan.k == 2 and plan.sharded and plan.kind == ("leader", "follower")[rank]
        _close(plan, res[rank])
        assert plan.memory["backbone"] < 0.6 * whole.memory["backbone"]   # about half of it each
        assert plan.sent["fsdp_gathers"] > 0 and (plan.sent["consensus"] > 0) == (rank == 0)


@pytest.mark.parametrize("args,says", [
    (["--nproc_per_node", "6", "micro_batches=2"], "world size 6"),
    (["--nproc_per_node", "8", "micro_batches=3", "batch_size=6"], "micro_batches=3 with 2 ranks per seat"),
    (["--nproc_per_node", "4", "lora_rank=0"], "lora_rank"),
    (["--nproc_per_node", "4", "--device_memory", "lots"], "--device_memory 'lots'"),
])
def test_a_job_the_trainer_would_refuse_is_refused_in_one_line(args, says, capsys):
    memory = [] if "--device_memory" in args else ["--device_memory", "24GiB"]
    code = plan_command.main([*TINY, *memory, *args])      # in this process: refused before any rehearsal
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("admm_dist.plan: error: ") and says in lines[0], err


def test_a_job_that_does_not_fit_is_told_a_change_that_does_rehearsed(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = plan_command.main([*TINY, "max_target_tokens=64", "--nproc_per_node", "4", "--device_memory", "6MiB",
                              "--json", str(out)])     # the command's own main, in this process
    said = capsys.readouterr().out
    assert code == 3, said
    verdict = json.loads(out.read_text())
    assert not verdict["fits"] and max(p["peak"] for p in verdict["plans"]) > 0.9 * 6 * 2 ** 20
    fix = verdict["fix"]
    assert fix is not None and fix["peak"] <= 0.9 * 6 * 2 ** 20, said
    assert f"fix: {fix['change']}" in said and "torchrun --nnodes" in said
