"""Evaluation on the stand-in backbone: accuracy, determinism, adapters (one vector, per-seat
local states), a compromised seat on another backbone, the leakage check, and bad input."""
import json
import os
import subprocess
import sys

import pytest
import torch

from admm_dist.cli.evaluate import main
from admm_dist.data import queries

from conftest import REPO

ROOT = str(REPO)
STANDIN = os.path.join(ROOT, "assets", "standin")
TINY = os.path.join(ROOT, "assets", "tiny", "backbone")
ADAPTER = dict(lora_rank=4, lora_alpha=8.0, lora_layers_last=2, lora_basis_seed=42)
BASE = ["--task", "chain_arith", "--model_name", STANDIN, "--max_new_tokens", "12", "--device", "cpu"]


def evaluate(capsys, *extra, n=8):
    rc = main(BASE + ["--n", str(n)] + list(extra))
    out, err = capsys.readouterr()
    return rc, out, err


def chains(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def texts(path, seat):
    return [c["messages"][seat]["text"] for c in chains(path)]


def random_vector(backbone, seed, scale=2.0):
    """A BOnlyLoRA on ``backbone`` and a nonzero vector for it."""
    from transformers import AutoModelForCausalLM

    from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
    model = AutoModelForCausalLM.from_pretrained(backbone, local_files_only=True)
    adapter = BOnlyLoRA(model, AdapterConfig(**ADAPTER))
    return adapter, torch.randn(adapter.numel, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture(scope="module")
def base8(tmp_path_factory):
    """The bare stand-in on rows [0, 8): the reference the other runs are compared with."""
    path = str(tmp_path_factory.mktemp("base") / "t.jsonl")
    assert main(BASE + ["--n", "8", "--save_trajectories", path]) == 0
    return path


def test_accuracy_trajectories_json_and_repeatable(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rc, out, _ = evaluate(capsys, "--save_trajectories", str(a), "--json", str(tmp_path / "s.json"), n=40)
    assert rc == 0 and out.startswith("accuracy ") and "on chain_arith eval rows [0, 40)" in out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert 0 < summary["accuracy"] < 1 and summary["n"] == 40 and summary["seconds"] > 0
    rows = chains(a)
    assert len(rows) == 40 and sum(r["correct"] for r in rows) == summary["correct"]
    first = rows[0]
    assert [m["role"] for m in first["messages"]] == ["Planner", "Critic", "Refiner", "Judger"]
    assert first["question"] in first["messages"][0]["prompt"] and first["final"] == first["messages"][-1]["text"]
    assert [r["anchor"] for r in rows] == [r["anchor"] for r in queries.pool("chain_arith", seed=42)[:40]]
    rc, out2, _ = evaluate(capsys, "--save_trajectories", str(b), n=40)
    assert rc == 0 and out2.splitlines() == out.splitlines()[:-1] and chains(b) == rows
    assert out.splitlines()[-1] == f"wrote {tmp_path / 's.json'}"   # where the summary went


def test_dtype_bfloat16_runs_the_backbone_in_bfloat16_and_says_so(tmp_path, capsys, base8):
    path = tmp_path / "bf16.jsonl"
    rc, out, _ = evaluate(capsys, "--dtype", "bfloat16", "--save_trajectories", str(path),
                          "--json", str(tmp_path / "s.json"))
    assert rc == 0 and json.loads((tmp_path / "s.json").read_text())["settings"]["dtype"] == "bfloat16"
    assert [c["anchor"] for c in chains(path)] == [c["anchor"] for c in chains(base8)]


def test_adapter_vector_changes_outputs(tmp_path, capsys, base8):
    from admm_dist.model.vectors import save_vector
    adapter, vec = random_vector(STANDIN, 0)
    save_vector(str(tmp_path / "run-last.safetensors"), vec, {"selection": "test"}, adapter=adapter)
    path = str(tmp_path / "t.jsonl")
    rc, out, err = evaluate(capsys, "--adapter", str(tmp_path / "run-last.safetensors"), "--save_trajectories", path)
    assert rc == 0, err
    assert "leakage not checked" in err  # no report next to this vector
    assert any(texts(path, s) != texts(base8, s) for s in range(4))
    assert all(m["adapted"] for c in chains(path) for m in c["messages"])


def write_state(folder, vectors, *, local_only=True, report_dir=None, rounds=None):
    """A training run's <out> folder in the trainer's format (write_results); ``rounds``: the
    round each node file records (the seat map's is the first)."""
    from safetensors.torch import save_file

    from admm_dist.training.config import TrainConfig
    cfg = TrainConfig(model_name=STANDIN, task="chain_arith", local_only=local_only, out=str(folder),
                      report_dir=report_dir or "results", **ADAPTER)
    os.makedirs(folder, exist_ok=True)
    rounds = rounds or [5] * len(vectors)
    for i, (x, z) in enumerate(vectors):
        save_file({"x": x.clone(), "z": z.clone(), "u": torch.zeros_like(x)},
                  os.path.join(folder, f"node-{i}.safetensors"), metadata={"round": str(rounds[i])})
    seats = cfg.adapted_seats()
    with open(os.path.join(folder, "seat_map.json"), "w") as fh:
        json.dump({"config": cfg.as_dict(), "seats": seats, "roles": [cfg.role(s) for s in seats],
                   "n_nodes": len(vectors), "round": rounds[0], "deploy_required": "local" if local_only else None,
                   "node_of_seat": {str(s): i for i, s in enumerate(seats)}}, fh)


def test_deploy_local_reads_each_seats_node(tmp_path, capsys, base8):
    _, big = random_vector(STANDIN, 1)
    zero = torch.zeros_like(big)
    # x is zero except on seat 2's node; z is large everywhere (local_only: z must not be used)
    write_state(tmp_path / "run", [(big if i == 2 else zero, big * -1.5) for i in range(4)])
    path = str(tmp_path / "t.jsonl")
    rc, _, err = evaluate(capsys, "--deploy", "local", "--state", str(tmp_path / "run"), "--save_trajectories", path)
    assert rc == 0, err
    assert texts(path, 0) == texts(base8, 0) and texts(path, 1) == texts(base8, 1)
    assert texts(path, 2) != texts(base8, 2)
    # the run has no exact consensus: deploying "its consensus" is refused
    rc, _, err = evaluate(capsys, "--state", str(tmp_path / "run"))
    assert rc == 2 and "--deploy local" in err
    # a node file left from an earlier round (its rank failed the final write) is refused
    write_state(tmp_path / "stale", [(big, big) for _ in range(4)], rounds=[5, 5, 4, 5])
    rc, _, err = evaluate(capsys, "--deploy", "local", "--state", str(tmp_path / "stale"))
    assert rc == 2 and "node-2.safetensors holds round 4 but the run's seat_map.json is of round 5" in err, err


def test_agent_model_runs_one_seat_on_another_backbone(tmp_path, capsys, base8):
    path = str(tmp_path / "t.jsonl")
    rc, _, err = evaluate(capsys, "--agent_models", f"1={TINY}", "--save_trajectories", path)
    assert rc == 0, err
    assert texts(path, 0) == texts(base8, 0) and texts(path, 1) != texts(base8, 1)
    assert {c["messages"][1]["model"] for c in chains(path)} == {TINY}


def test_rows_a_training_report_lists_are_refused(tmp_path, capsys):
    rows = queries.pool("chain_arith", seed=42)[:8]
    report = tmp_path / "r-train.json"
    report.write_text(json.dumps({"anchor_keys": [rows[3]["anchor"], "other"]}))
    rc, out, err = evaluate(capsys, "--train_report", str(report))
    assert rc == 2 and out == "" and "1 of 8 evaluation rows were training queries" in err
    assert evaluate(capsys, "--train_report", str(report), "--offset", "4", n=1)[0] == 0
    # found without --train_report: <report_dir>/<name>-train.json of the run next to the vector
    from admm_dist.model.vectors import save_vector
    adapter, vec = random_vector(STANDIN, 0)
    save_vector(str(tmp_path / "run-last.safetensors"), vec, {}, adapter=adapter)
    write_state(tmp_path / "run", [(vec, vec)] * 4, local_only=False, report_dir=str(tmp_path / "reports"))
    os.makedirs(tmp_path / "reports")
    (tmp_path / "reports" / "run-train.json").write_text(report.read_text())
    rc, _, err = evaluate(capsys, "--adapter", str(tmp_path / "run-last.safetensors"))
    assert rc == 2 and "1 of 8" in err and "run-train.json" in err


@pytest.fixture(scope="module")
def tiny_vector(tmp_path_factory):
    from admm_dist.model.vectors import save_vector
    adapter, vec = random_vector(TINY, 0)
    path = str(tmp_path_factory.mktemp("tiny") / "tiny-last.safetensors")
    save_vector(path, vec, {}, adapter=adapter)
    return path


@pytest.mark.parametrize("extra, words", [
    (["--adapter", "/nonexistent/x-last.safetensors"], "no B-vector file"),
    (["--adapter", "TINY_VECTOR"], "this adapter"),
    (["--agent_models", "7=" + TINY], "unknown seat 7"),
    (["--agent_models", "1"], "SEAT=PATH"),
    (["--agent_models", "1=/nonexistent/model"], "no such model folder"),
    (["--model_name", "/nonexistent/model"], "no such model folder"),
    (["--task", "harmbench"], "--judge"),
    (["--task", "nope"], "unknown task"),
    (["--n", "0"], "--n 0"),
    (["--n", "100000"], "exceed the pool"),
    (["--samples", "2"], "--temperature > 0"),
    (["--deploy", "local"], "--state"),
    (["--state", "/nonexistent/run"], "seat_map.json"),
    (["--train_report", "/nonexistent/r.json"], "does not exist"),
    (["--prompt", "nope"], "invalid choice"),
    (["--n_ops", "0"], "n_ops=0: use an integer from 1 to 16"),
    (["--dtype", "float16"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tiny_vector, extra, words):
    extra = [tiny_vector if e == "TINY_VECTOR" else e for e in extra]
    rc, out, err = evaluate(capsys, *extra, n=2)
    assert rc == 2 and words in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_module_entry_point_one_line_error(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "admm_dist.evaluate", "--task", "chain_arith", "--model_name",
                        str(tmp_path / "missing"), "--n", "2"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [f"admm-dist-evaluate: error: --model_name {tmp_path / 'missing'}: "
                                             f"no such model folder (give a folder with config.json or a hub id)"]


def test_a_copied_adapter_still_refuses_its_training_rows(tmp_path, capsys):
    """The trainer writes the anchor keys into the adapter file: a copy with no report near it
    keeps the leakage check."""
    from admm_dist.model.vectors import save_vector
    rows = queries.pool("chain_arith", seed=42)[:8]
    adapter, vec = random_vector(STANDIN, 0)
    copy = tmp_path / "elsewhere" / "mine.safetensors"
    os.makedirs(copy.parent)
    save_vector(str(copy), vec, {"anchor_keys": [rows[5]["anchor"]]}, adapter=adapter)
    rc, out, err = evaluate(capsys, "--adapter", str(copy))
    assert rc == 2 and out == "" and "1 of 8 evaluation rows were training queries" in err
    assert str(copy) in err


@pytest.mark.parametrize("flag", ["--json", "--save_trajectories"])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_model_loads(capsys, tmp_path, monkeypatch, flag):
    """Checked in prepare(), like the trainer's outputs: not after the whole evaluation has run."""
    from admm_dist.mas import evaluation

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the output paths were checked")
    monkeypatch.setattr(evaluation, "roll_out", no_model)
    for path, words in ((os.path.join(ROOT, "README.md", "e.json"), "README.md is a file"),
                        (str(tmp_path), "is a folder")):
        rc, out, err = evaluate(capsys, flag, path, n=2)
        assert rc == 2 and f"{flag} {path}" in err and words in err, err
        assert len(err.strip().splitlines()) == 1 and out == ""


def test_n_ops_sets_the_problems_evaluated(tmp_path, capsys):
    """chain_arith with two operations a problem (the stand-in's chain has four seats): the rows
    are two-operation problems, and the summary records n_ops."""
    rc, out, err = evaluate(capsys, "--n_ops", "2", "--json", str(tmp_path / "s.json"),
                            "--save_trajectories", str(tmp_path / "t.jsonl"), n=4)
    assert rc == 0, err
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["settings"]["n_ops"] == 2
    assert all(len(c["question"].split(":")[1].split()) == 2 for c in chains(tmp_path / "t.jsonl"))
