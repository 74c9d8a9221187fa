"""launch/slurm.sbatch on a real single-host SLURM (tests/cluster.py): preemption by USR2,
requeue, resume=auto, and that a neighbouring job on the same node is left alone.

Slow (``python3 -m pytest -m slow tests/launch/test_slurm.py``); needs root and slurm-wlm.
"""
import os
import re
import subprocess
import sys
import time

import pytest

from cluster import (
    REPO,
    SCRIPT,
    Cluster,
    assert_same_outputs,
    environ_of,
    has_checkpoint,
    log_of,
    missing,
    pids_of,
    submit_dir,
    tiny_assets,
    train_args,
    wait_for,
)

N = 3
K = 40   # rounds: long enough that the neighbour is mid-run when the USR2 comes

pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing() is not None, reason=str(missing()))]

FAKE = '''"""Stand-in worker for the batch script's decisions: the real contract, no training."""
import os, signal, sys, time
from admm_dist.engine.preemption import record_pid, write_status
got = []
signal.signal(signal.SIGUSR2, lambda *a: got.append(time.time()))
rank = int(os.environ["RANK"])
unrecord = record_pid(rank)
again = os.path.join(os.environ["ADMM_JOB_DIR"], f"fake-rank{rank}")   # a requeued start ends at once
wait = 0 if os.path.exists(again) else float(sys.argv[1])
open(again, "w").close()
end = time.time() + wait
while not got and time.time() < end:
    time.sleep(0.1)
state = sys.argv[2] if got else "finished"
if rank == 0:
    write_status(state, round_=3 if state == "preempted" else None, out="fake", message="fake")
unrecord()
print(f"fake rank {rank}: usr2={len(got)} state={state}", flush=True)
'''

# Stand-in ranks that leave together once any one of them is asked, as a real run's ranks do
# (they agree on the stop at the end of the round, checkpoint and exit, each removing its PID
# file): the first one asked takes the others' PID files away at once (their leaving, as a
# forward that reads one file at a time meets it) and stops them half a second later (the end
# of its round). A forward that reads and signals one PID file at a time, forking between them,
# finds the others' files gone; one that reads every file first asks them all.
PEERS = '''"""Stand-in ranks that stop together once any one of them is asked."""
import os, signal, sys, time
from admm_dist.engine.preemption import record_pid
rank = int(os.environ["RANK"])
got, left = [], []
unrecord = lambda: None
folder = os.path.join(os.environ["ADMM_JOB_DIR"], "pids")
def leave(*_):
    if left:   # a SIGTERM while already leaving (after its USR2)
        return
    left.append(1)
    unrecord()
    print(f"peer rank {rank}: usr2={len(got)}", flush=True)
    os._exit(0)
def asked(*_):
    got.append(time.time())
    others = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            with open(path) as fh:
                pid = int(fh.read())
            if pid != os.getpid():
                os.unlink(path)   # it is leaving: its PID file goes
                others.append(pid)
        except (OSError, ValueError):
            pass
    time.sleep(0.5)               # the end of the round: the others stop too
    for pid in others:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    leave()
signal.signal(signal.SIGTERM, leave)
signal.signal(signal.SIGUSR2, asked)
unrecord = record_pid(rank)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    time.sleep(0.05)
print(f"peer rank {rank}: never asked", flush=True)
unrecord()
'''

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("assets")
    a = tiny_assets(d, N)
    (d / "fake").mkdir()
    (d / "fake" / "fakejob.py").write_text(FAKE)
    (d / "fake" / "fakepeers.py").write_text(PEERS)
    return dict(a, fake=str(d / "fake"))


def job_env(assets, **kw):
    env = dict(NPROC_PER_NODE=str(N), VENV=sys.prefix, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), assets["fake"]]))
    env.update(kw)
    return env


def port_of(log):
    ports = re.findall(r"rendezvous \S+:(\d+);", log)
    assert ports, log[-2000:]
    return int(ports[0])


@pytest.mark.timeout(600)
def test_preempted_job_requeues_resumes_bit_identical_and_leaves_its_neighbour_alone(cluster, assets, tmp_path):
    t0 = time.monotonic()
    sub = submit_dir(tmp_path)
    env = job_env(assets)
    cut = cluster.sbatch(SCRIPT, ["admm_dist.train"] + train_args(assets, sub / "cut", k_outer=K), cwd=str(sub), env=env)
    ref = cluster.sbatch(SCRIPT, ["admm_dist.train"] + train_args(assets, sub / "ref", k_outer=K), cwd=str(sub), env=env)
    try:
        wait_for(lambda: has_checkpoint(sub / "cut") or cluster.state(cut) not in ("PENDING", "RUNNING", ""), 240,
                 "the first checkpoint of the job to preempt")
    except TimeoutError:
        pytest.fail(f"no checkpoint: {cluster.job(cut)}\n{log_of(sub, cut)[-3000:]}")
    assert has_checkpoint(sub / "cut"), log_of(sub, cut)[-3000:]
    # the neighbour is mid-run: RUNNING, its 3 workers alive and recorded, not finished
    wait_for(lambda: len(pids_of(sub, ref)) == N, 60, "the neighbour's workers")
    ref_pids = [int(p.read_text()) for p in pids_of(sub, ref)]
    assert cluster.state(ref) == "RUNNING"
    assert all(environ_of(p).get("SLURM_JOB_ID") == ref for p in ref_pids)
    assert not (sub / "logs" / ref / "status.json").exists()

    t_usr2 = time.monotonic()
    cluster.signal_batch(cut)   # what --signal=B:USR2@120 does near the time limit
    wait_for(lambda: "SIGUSR2: asked" in log_of(sub, cut), 60, "the forward of USR2")
    # the forward is done and the neighbour's workers are still there, still training
    assert all(environ_of(p).get("SLURM_JOB_ID") == ref for p in ref_pids), log_of(sub, ref)[-2000:]
    assert not (sub / "logs" / ref / "status.json").exists(), "the neighbour finished before the USR2 test point"

    rinfo = cluster.wait_done(ref, 300)
    t_ref = time.monotonic()
    info = cluster.wait_done(cut, 300)
    log, rlog = log_of(sub, cut), log_of(sub, ref)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log[-3000:])
    assert info["Restarts"] == "1", info
    assert rinfo["JobState"] == "COMPLETED" and rinfo["ExitCode"] == "0:0" and rinfo["Restarts"] == "0", rinfo

    # the log is appended across the requeue: the first start's lines are still there
    first_round = log.index("round   1/")
    m = re.search(r"admm_dist.train: preempted after round (\d+):", log)
    assert m, log[-3000:]
    k = int(m.group(1))
    assert 1 <= k < K
    requeue = log.index(f"slurm.sbatch: stopped for preemption after round {k}; requeueing job {cut}")
    assert log.index(f"job {cut} start 1 ") < first_round < m.start() < requeue
    assert log.index(f"job {cut} start 2 ") > requeue
    assert log.index(f"resume auto: continuing after round {k}") > requeue
    # every worker of this job was asked, by PID (the forward reads every PID file before it
    # signals any: the ranks leave together once one of them has the warning)
    assert f"SIGUSR2: asked {N} worker(s) of job {cut} " in log, log[-3000:]
    assert "Traceback" not in log

    # the neighbour was never preempted, ran all rounds, and finished
    for line in ("SIGUSR2", "preempted after round", "stopped for preemption", f"job {ref} start 2"):
        assert line not in rlog, (line, rlog[-3000:])
    assert f"round {K:3d}/{K}" in rlog and "done:" in rlog
    assert '"finished"' in (sub / "logs" / ref / "status.json").read_text()
    assert '"finished"' in (sub / "logs" / cut / "status.json").read_text()

    # resumed == uninterrupted, bit for bit (z and every node's x, z, u)
    assert_same_outputs(sub / "cut", sub / "ref", range(N))

    # logs under logs/, nothing in the submit dir itself; one port per job
    assert sorted(p.name for p in sub.iterdir()) == ["cut", "logs", "ref"]
    assert port_of(log) != port_of(rlog)
    print(f"preempt+requeue test: {time.monotonic() - t0:.1f} s: USR2 at {t_usr2 - t0:.1f} s, "
          f"neighbour done at {t_ref - t0:.1f} s (stopped after round {k})")


def test_requeue_only_a_preempted_run_and_only_when_allowed(cluster, assets, tmp_path):
    """Stand-in workers (the real pid/status contract) test the script's decisions fast:
    --no-requeue -> one clear line and exit 75 (here the USR2 comes before any worker has
    recorded its PID: the forward waits until every one has, then asks them all); a run that
    finished despite the USR2 is not requeued; a PID in the pid folder that is not this job's
    is never signalled."""
    sub = submit_dir(tmp_path)
    env = job_env(assets)
    norq = cluster.sbatch(SCRIPT, ["fakejob", "90", "preempted"], options=["--no-requeue"], cwd=str(sub), env=env)
    done = cluster.sbatch(SCRIPT, ["fakejob", "90", "finished"], cwd=str(sub), env=env)
    plain = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    other = subprocess.Popen(["sleep", "120"], env=dict(plain, SLURM_JOB_ID=norq))   # "another job's worker"
    reused = subprocess.Popen(["sleep", "120"], env=plain)                          # a reused PID
    try:
        wait_for(lambda: f"job {norq} start 1 " in log_of(sub, norq), 120, f"job {norq} to start")
        assert pids_of(sub, norq) == []
        cluster.signal_batch(norq)   # early: its workers are still starting
        wait_for(lambda: len(pids_of(sub, done)) == N, 120, f"the workers of job {done}")
        host = pids_of(sub, done)[0].name.split("-rank")[0]
        for rank, p in ((7, other), (8, reused)):
            (sub / "logs" / done / "pids" / f"{host}-rank{rank}.pid").write_text(f"{p.pid}\n")
        cluster.signal_batch(done)
        a = cluster.wait_done(norq, 120)
        b = cluster.wait_done(done, 120)
        la, lb = log_of(sub, norq), log_of(sub, done)
        assert a["JobState"] == "FAILED" and a["ExitCode"] == "75:0" and a["Restarts"] == "0", (a, la)
        assert a["Requeue"] == "0"
        assert ("slurm.sbatch: stopped for preemption after round 3; requeue is off for this job: "
                "resubmit the same command with resume=auto") in la
        assert "Traceback" not in la and "asked 3 worker(s)" in la, la
        assert b["JobState"] == "COMPLETED" and b["ExitCode"] == "0:0" and b["Restarts"] == "0", (b, lb)
        assert "SIGUSR2 came but the run ended as 'finished' (status 0): not requeueing" in lb
        assert "requeueing job" not in lb and "asked 3 worker(s)" in lb, lb
        assert other.poll() is None and reused.poll() is None, "a process outside the job got USR2"
    finally:
        for p in (other, reused):
            p.kill()
            p.wait(timeout=10)


def test_every_worker_is_asked_even_when_the_first_asked_stops_the_others(cluster, assets, tmp_path):
    """The ranks leave together once any of them has the warning (each removing its PID file):
    the forward reads every PID file of the node first, then asks them all, so none is missed."""
    sub = submit_dir(tmp_path)
    job = cluster.sbatch(SCRIPT, ["fakepeers", "60"], cwd=str(sub), env=job_env(assets))
    wait_for(lambda: len(pids_of(sub, job)) == N or cluster.state(job) not in ("PENDING", "RUNNING", ""), 120,
             f"the workers of job {job}")
    assert len(pids_of(sub, job)) == N, (cluster.job(job), log_of(sub, job))
    cluster.signal_batch(job)
    info = cluster.wait_done(job, 120)
    log = log_of(sub, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log)
    asked = re.findall(r"SIGUSR2: asked (\d+) worker\(s\)[^\n]*", log)
    assert len(asked) == 1 and f"SIGUSR2: asked {N} worker(s) of job {job} " in log, log
    assert set(re.findall(r"peer rank (\d+): usr2=1", log)) == {str(r) for r in range(N)}, log
    assert "usr2=0" not in log and "never asked" not in log, log
    assert "without the go" not in log and "kill failed" not in log
    assert pids_of(sub, job) == [] and "Traceback" not in log


def test_setup_errors_are_one_clear_line(cluster, assets, tmp_path):
    sub = submit_dir(tmp_path)
    notorch = tmp_path / "notorch" / "bin"
    notorch.mkdir(parents=True)
    (notorch / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")   # no site-packages
    (notorch / "python3").chmod(0o755)
    cases = {
        "no NPROC_PER_NODE": (job_env(assets, NPROC_PER_NODE=""),
                              "no GPUs allocated to this job: set NPROC_PER_NODE (nodes x ranks per node = seats"),
        "no torch": (job_env(assets, VENV=str(notorch.parent)), "cannot import torch with "),
        "no venv": (job_env(assets, VENV=str(tmp_path / "nowhere")), "has no bin/ folder"),
        "bad module": (job_env(assets), "cannot find module admm_dist.nosuch"),
        "bad NPROC_PER_NODE": (job_env(assets, NPROC_PER_NODE="two"), "NPROC_PER_NODE=two: give a positive whole number"),
        "bad RDZV_PORT": (job_env(assets, RDZV_PORT="70000"), "RDZV_PORT=70000: give a TCP port number (1-65535)"),
    }
    jobs = {name: cluster.sbatch(SCRIPT, ["admm_dist.nosuch" if name == "bad module" else "admm_dist.train"],
                                 cwd=str(sub), env=e) for name, (e, _) in cases.items()}
    for name, (_, want) in cases.items():
        info = cluster.wait_done(jobs[name], 60)
        log = log_of(sub, jobs[name])
        assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (name, info, log)
        lines = [line for line in log.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("slurm.sbatch: error: ") and want in lines[0], (name, log)
