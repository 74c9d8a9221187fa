"""SIGUSR2 (SLURM's warning before the time limit): every rank checkpoints the same round and
exits 0; ``resume=auto`` then finishes with the same z as a run that was never stopped."""
import os
import signal
import subprocess
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from admm_dist.bench.launcher import launch_cpu

from conftest import cli_rank, tiny_args, train_cmd

N = 2       # ranks (one per seat): the signal reaches one, every rank must act on it
K = 12      # rounds: the stop arrives after round 1 and is taken at the end of a round


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(N)


def _args(assets, out, **kw):
    return tiny_args(assets, **dict(dict(k_outer=K, checkpoint_every=100, timeout_s=60, out=str(out / "run"),
                                         report_dir=str(out / "rep")), **kw))



def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(p) for p in fh.read().split()]


def _preempt(args, nproc, deadline=240):
    """Start the run, send SIGUSR2 to one process once round 1 is logged, wait for the end."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.Popen(train_cmd(args, nproc), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, t0 = [], time.time()
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith("round   1/"):
                target = p.pid if nproc == 1 else _children(p.pid)[-1]   # one worker only
                os.kill(target, signal.SIGUSR2)
            if time.time() - t0 > deadline:
                break
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    return rc, "".join(lines)


@pytest.mark.parametrize("nproc", [1, pytest.param(N, marks=pytest.mark.slow)])   # N ranks: ~22 s alone, slow
def test_sigusr2_checkpoints_every_rank_and_resume_finishes_the_same(assets, tmp_path, nproc, capfd):
    from admm_dist.cli import train

    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    rc, out = _preempt(_args(assets, tmp_path / "cut"), nproc)
    assert rc == 0, out[-2000:]
    stopped = [line for line in out.splitlines() if "preempted after round" in line]
    assert len(stopped) == 1, out[-2000:]
    k = int(stopped[0].split("preempted after round ")[1].split(":")[0])
    assert 1 <= k < K
    rounds = sorted(os.listdir(tmp_path / "cut" / "run.ckpt"))
    assert rounds[-1] == f"round-{k:06d}", rounds
    assert not os.path.exists(tmp_path / "cut" / "run-last.safetensors")
    resume = _args(assets, tmp_path / "cut", resume="auto")
    if nproc == 1:    # the command's own main in this process: no interpreter to start
        capfd.readouterr()
        assert train.main(resume) == 0
        said = capfd.readouterr().out
    else:
        done = subprocess.run(train_cmd(resume, nproc), env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        said = done.stdout
    assert f"continuing after round {k}" in said
    # the run that is never stopped, in this process (the numbers do not depend on the
    # placement: tests/training/test_trainer.py)
    assert train.main(_args(assets, tmp_path / "clean")) == 0
    a = load_file(str(tmp_path / "clean" / "run-last.safetensors"))["b"]
    b = load_file(str(tmp_path / "cut" / "run-last.safetensors"))["b"]
    assert torch.equal(a, b)


def test_sigusr2_during_set_up_stops_cleanly_and_the_job_dir_says_so(assets, tmp_path, monkeypatch, capfd):
    """The note is in place from the first line of train.main: a warning that arrives while
    the ranks load (sent to the first that records its PID, found by that PID, never by name)
    stops the run after set-up. The ranks are the training command's under torch's elastic
    agent (what torchrun runs), forked from the launcher's fork server."""
    import json
    job = tmp_path / "job"
    monkeypatch.setenv("ADMM_JOB_DIR", str(job))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sent = []

    def warn_the_first_rank():   # whole PID files only: not a temporary about to be renamed into place
        deadline = time.time() + 120
        while time.time() < deadline and not sent:
            folder = job / "pids"
            pids = sorted(f for f in os.listdir(folder) if f.endswith(".pid")) if folder.is_dir() else []
            if pids:
                with open(job / "pids" / pids[0]) as fh:
                    sent.append(int(json.load(fh)))
                os.kill(sent[0], signal.SIGUSR2)      # one worker of this job only
            time.sleep(0.002)
    warner = threading.Thread(target=warn_the_first_rank, daemon=True)
    warner.start()
    done = launch_cpu(cli_rank, N, _args(assets, tmp_path, resume="auto"), timeout_s=120, setup=False)
    warner.join(timeout=10)
    assert sent and done == {r: 0 for r in range(N)}
    assert "preempted during set-up, before round 1: nothing to resume yet" in capfd.readouterr().out
    status = json.loads((job / "status.json").read_text())
    assert status["state"] == "preempted" and status["round"] == 0
    assert os.listdir(job / "pids") == []                     # every worker removed its PID file
    assert not os.path.exists(tmp_path / "run.ckpt") and not os.path.exists(tmp_path / "run-last.safetensors")
    # the requeued job finishes, and the job dir says so
    requeued = _args(assets, tmp_path, resume="auto", k_outer=2)
    assert launch_cpu(cli_rank, N, requeued, timeout_s=120, setup=False) == {r: 0 for r in range(N)}
    assert json.loads((job / "status.json").read_text())["state"] == "finished"


@pytest.mark.slow
def test_a_rank_stopped_during_start_up_is_one_line_on_the_others(assets, tmp_path):
    """SIGSTOP one worker as soon as it exists: the others give up within timeout_s with one
    line (or are ended by torchrun when another gave up first; no DistStoreError/gloo tracebacks
    from our workers), then it is let go."""
    import json
    job = tmp_path / "job"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", ADMM_JOB_DIR=str(job))
    p = subprocess.Popen(train_cmd(_args(assets, tmp_path, timeout_s=8), N), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    stopped = None
    try:
        deadline = time.time() + 120
        # the first worker to record its PID is stopped at once: the group cannot have formed
        # yet, as the others had not all started (they record their PIDs before joining it)
        def recorded():   # whole PID files only: not a temporary about to be renamed into place
            return sorted(f for f in os.listdir(job / "pids") if f.endswith(".pid")) if (job / "pids").is_dir() else []
        while time.time() < deadline and not recorded():
            time.sleep(0.002)
        first = recorded()[0]
        for _ in range(100):   # the file appears by rename: its content is complete once it is there
            try:
                with open(job / "pids" / first) as fh:
                    stopped = int(json.load(fh))
                break
            except (OSError, ValueError):
                time.sleep(0.01)
        os.kill(stopped, signal.SIGSTOP)
        lines = []
        for line in p.stdout:           # bounded: every other rank fails within timeout_s
            lines.append(line)
            # the first rank to give up ends the job: let the stopped one go now, or torchrun
            # waits its 30 s for a stopped worker to take the SIGTERM it sends
            if "admm_dist.train: error on rank" in line or time.time() > deadline:
                break
        try:   # torchrun's SIGTERM, pending while stopped, now ends it (unless it was killed already)
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
        out, _ = p.communicate(timeout=120)
        lines.append(out)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            p.kill()
    text = "".join(lines)
    errs = [line for line in text.splitlines() if "admm_dist.train: error on rank" in line]
    # the first rank to give up ends the job: torchrun then terminates the others, which may
    # still be inside their own wait (they started later), so at least one line, not N - 1
    assert errs, text[-3000:]
    assert all("another rank stopped, died or cannot be reached" in e or "timed out" in e.lower()
               or "peer" in e.lower() for e in errs), errs
    assert not [line for line in text.splitlines() if line.strip().startswith("File ") and "admm_dist/" in line]
    assert p.returncode != 0


def test_a_pid_file_is_whole_and_only_its_own_worker_removes_it(tmp_path, monkeypatch):
    """The batch script globs ``<host>-rank*.pid``: the file appears whole (a hidden temporary
    renamed into place), and the removal at exit takes it away only in the process that wrote
    it and only while it still holds that PID (a restarted worker's own stays)."""
    from admm_dist.engine.preemption import pid_path, record_pid

    monkeypatch.setenv("ADMM_JOB_DIR", str(tmp_path))
    remove = record_pid(4)
    path = pid_path(str(tmp_path), 4)
    assert os.listdir(tmp_path / "pids") == [os.path.basename(path)]   # no temporary left beside it
    assert open(path).read() == f"{os.getpid()}\n"
    child = os.fork()
    if child == 0:            # a fork of the worker that runs the removal must not take it away
        remove()
        os._exit(0)
    os.waitpid(child, 0)
    assert os.path.exists(path)
    with open(path, "w") as fh:   # a newer worker of rank 4 recorded its PID meanwhile
        fh.write("12345\n")
    remove()
    assert open(path).read() == "12345\n"
    remove = record_pid(4)
    remove()
    assert os.listdir(tmp_path / "pids") == []
