"""launch/gpu_check.sh: the CPU smoke run of the whole pipeline, the refusal without a GPU, and
the step runner's limits (a step out of time is stopped with its process group, a failing one
is recorded and the next one runs)."""
import json
import os
import subprocess
import sys
import time

import pytest

from admm_dist.bench.gpu_check import Runner, vllm_version
from admm_dist.bench.xstep_measure import trl_version

from conftest import REPO

SCRIPT = str(REPO / "launch" / "gpu_check.sh")
STEPS = ["plan", "xstep", "backbone", "train_hf", "train_vllm", "collect"]


def _env(**kw):
    env = dict(os.environ, **kw)
    env.pop("PYTHONPATH", None)          # the script finds the package from its own location
    return env


@pytest.mark.slow
def test_cpu_smoke_runs_every_step_and_reports_figures(tmp_path):
    out = tmp_path / "out dir"           # a space in the path, and a cwd outside the repository
    t0 = time.monotonic()
    p = subprocess.run(["bash", SCRIPT, "--cpu-smoke", str(out)], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=280)
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["mode"] == "cpu-smoke" and rep["ok"] is True
    status = {s["name"]: s["status"] for s in rep["steps"]}
    assert list(status) == STEPS
    vllm = vllm_version()
    assert status.pop("train_vllm") == ("ok" if vllm else "skipped: vllm not installed")
    assert set(status.values()) == {"ok"}, rep["steps"]
    for s in rep["steps"]:
        if s["status"] == "ok":
            assert 0 < s["seconds"] <= s["limit_s"] and (out / s["log"]).is_file()
    fig = rep["figures"]
    plan = fig["plan"]      # rehearsed first: the x-step's job on the tiny backbone's shapes
    assert plan["fits"] and 0 < plan["memory_bytes"]["backbone"] < plan["peak_bytes"] < 1 << 30
    xs = fig["xstep"]
    assert xs["shape"] == "micro" and xs["device"] == "cpu"
    rows = {x["row"]: x for x in xs["rows"]}
    assert rows["ours (Trainer.xstep)"]["s_per_step"] > 0
    if trl_version() is not None:
        for label in ("TRL DPOTrainer", "TRL precompute_ref_log_probs"):
            assert rows[label]["s_per_step"] > 0 and rows[label]["over_ours_paired"] > 0
    hf = fig["train_hf"]
    assert hf["generation_backend"] == "hf" and hf["nodes"] == 4 and hf["rounds"] == 1
    assert hf["examples"] > 0 and hf["delta_w_rel"] > 0
    coll = {x["backend"]: x for x in fig["collect"]["rows"]}
    assert coll["hf"]["tok_per_s"] > 0 and coll["hf"]["model"] == "micro"
    assert ("vllm" in coll) == bool(vllm)
    table = (out / "gpu_check.md").read_text()
    assert table.strip() == rep["table"].strip() and rep["table"] in p.stdout
    assert "| plan | ok |" in table and "predicted peak" in table
    assert "| xstep | ok |" in table and "| train_hf | ok |" in table and "tok/s" in table
    assert "| ours (Trainer.xstep) |" in table
    save = next(s["command"] for s in rep["steps"] if s["name"] == "backbone")
    assert not os.path.exists(save[save.index("--save") + 1])          # the work folder is gone
    print(f"cpu smoke wall {wall:.1f} s (report {rep['wall_s']} s)")


def test_without_a_gpu_the_plain_form_prints_one_line_and_exits_2(tmp_path):
    p = subprocess.run(["bash", SCRIPT, str(tmp_path / "out")], cwd=tmp_path, capture_output=True, text=True,
                       env=_env(CUDA_VISIBLE_DEVICES=""), timeout=120)
    lines = (p.stdout + p.stderr).splitlines()
    assert p.returncode == 2 and len(lines) == 1, (p.stdout, p.stderr)
    assert lines[0].startswith("gpu_check: no CUDA GPU") and "--cpu-smoke" in lines[0]
    assert not (tmp_path / "out").exists()
    for args in ([], ["--cpu-smoke"], ["a", "b"], ["--fast", "a"]):
        p = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=30)
        assert p.returncode == 2 and len(p.stderr.splitlines()) == 1 and "usage:" in p.stderr


def _gone(pid):
    for _ in range(50):
        try:
            with open(f"/proc/{pid}/status") as fh:
                if "State:\tZ" in fh.read():
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    pytest.fail(f"process {pid} survived its step")


def test_a_step_out_of_time_is_stopped_with_its_group_and_the_next_one_runs(tmp_path):
    pids = tmp_path / "pids"
    code = ("import subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(pids)!r}, 'w').write(str(c.pid))\n"
            "time.sleep(120)\n")
    runner = Runner(str(tmp_path), budget_s=200, log=lambda m: None)
    t0 = time.monotonic()
    slow = runner.run("slow", [sys.executable, "-c", code], limit_s=3)
    assert slow["status"] == "timeout" and time.monotonic() - t0 < 30
    assert "still running after its limit of 3 s" in slow["error"]
    _gone(int(pids.read_text()))          # the grandchild went with its group
    bad = runner.run("bad", [sys.executable, "-c", "import sys; print('step went wrong'); sys.exit(3)"],
                     limit_s=30)
    assert bad["status"] == "failed" and bad["exit_code"] == 3 and bad["error"] == "step went wrong"
    leaves = code.replace("time.sleep(120)\n", "print('fine')\n")    # exits 0, its grandchild still asleep
    good = runner.run("good", [sys.executable, "-c", leaves], limit_s=30)
    assert good["status"] == "ok" and [s["name"] for s in runner.steps] == ["slow", "bad", "good"]
    _gone(int(pids.read_text()))          # what a finished step left in its group is stopped too
    runner.deadline = time.monotonic()    # no time left: the next step is recorded as skipped
    assert runner.run("late", [sys.executable, "-c", "pass"], 30)["status"] == "skipped: out of the time budget"
