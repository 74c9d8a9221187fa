"""Ctrl-C (SIGINT) and SIGTERM: one line per rank, exit 128 + signal, the checkpoints kept.

A terminal's Ctrl-C reaches the whole foreground process group: torchrun's agent and every
worker. The agent then forwards the signal to each worker once more and ends with its own
``SignalException`` traceback (torch's code, not ours: see docs/slurm.md). Each worker prints
``admm_dist.train: interrupted on rank R (Ctrl-C): ...`` and nothing else, rank 0 writes the
``interrupted`` state for the batch script, and ``resume=auto`` continues after the last round
every rank completed.

Every run here is started in its own session (its process group id is its PID); the signal
goes to that group, as a terminal's would, and whatever is left of it is killed by that id.
Every wait is bounded.
"""
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, tiny_args, train_cmd

N = 2
ONE_LINE = re.compile(r"^admm_dist\.train: interrupted on rank (\d+) \((Ctrl-C|SIGTERM)\)")
AGENT_LOG = re.compile(r"^[IWE]\d{4} ")     # torchrun's agent's own log lines (glog style)
FRAME = re.compile(r'File "[^"]*admm_dist/')  # a traceback frame of ours


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(N)


def _args(assets, tmp_path, **kw):
    return tiny_args(assets, **dict(dict(k_outer=200, timeout_s=60, out=str(tmp_path / "run"),
                                         report_dir=str(tmp_path / "rep")), **kw))



def _session(sid):
    """Live processes of session ``sid`` (by /proc; zombies are not alive)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


class Run:
    """A command in its own session; its output (stdout and stderr together) read by a thread."""

    def __init__(self, cmd, job):
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", ADMM_JOB_DIR=str(job))
        self.p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True)
        self.lines, self._q = [], queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, pattern, deadline):
        """Lines until one starts with ``pattern``; False if the output ended or time ran out."""
        while time.time() < deadline:
            try:
                line = self._q.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                self._q.put(None)
                return False
            self.lines.append(line)
            if line.startswith(pattern):
                return True
        return False

    def signal_group(self, sig):
        os.killpg(self.p.pid, sig)      # the group this session made: a terminal's Ctrl-C
        return len(self.lines)

    def finish(self, timeout):
        """Exit status and every line, once the command and everything of its session are gone."""
        try:
            rc = self.p.wait(timeout=timeout)
            deadline = time.time() + 15
            while _session(self.p.pid) and time.time() < deadline:
                time.sleep(0.1)
            left = _session(self.p.pid)
            assert not left, f"left behind: {left}"
            self.wait_for("\0", time.time() + 5)     # drain what is still in the pipe
            return rc, self.lines
        finally:
            if self.p.poll() is None or _session(self.p.pid):
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.p.wait(timeout=30)


def _ours(lines):
    """The lines that are not torchrun's agent's: its log lines and its closing traceback."""
    out, agent_tb = [], False
    for line in lines:
        if line.startswith("Traceback (most recent call last):") and not agent_tb:
            agent_tb = True        # the agent's: checked apart (no admm_dist frame, SignalException)
        if not agent_tb and not AGENT_LOG.match(line):
            out.append(line.rstrip("\n"))
    return out


def _agent_traceback(lines):
    text = "".join(lines)
    if "Traceback" not in text:
        return ""
    return text[text.index("Traceback (most recent call last):"):]


def _check_torchrun_lines(lines, before, how):
    """After the signal: one line per rank from our workers and nothing else of ours; torchrun's
    agent adds its log lines and its own traceback, with no frame of ours in it."""
    text = "".join(lines)
    after = _ours(lines[before:])
    said = [ONE_LINE.match(line) for line in after if ONE_LINE.match(line)]
    assert sorted(int(m.group(1)) for m in said) == list(range(N)), text[-3000:]
    assert all(m.group(2) == how for m in said), said
    assert [line for line in after if not ONE_LINE.match(line) and not line.startswith("round ")] == [], text[-3000:]
    assert "[rank" not in text and not FRAME.search(text), text[-3000:]
    tb = _agent_traceback(lines[before:])
    assert tb == "" or tb.rstrip().splitlines()[-1].startswith(
        "torch.distributed.elastic.multiprocessing.api.SignalException"), tb
    assert text.count("Traceback") <= 1, text[-3000:]
    return said


def test_ctrl_c_under_torchrun_is_one_line_per_rank_and_the_run_resumes(assets, tmp_path, capfd, monkeypatch):
    job = tmp_path / "job"
    run = Run(train_cmd(_args(assets, tmp_path), N), job)
    before = None
    try:
        # round 2 is logged once every rank has written round 1's checkpoint
        if run.wait_for("round   2/", time.time() + 120):
            before = run.signal_group(signal.SIGINT)
    finally:
        rc, lines = run.finish(timeout=60)
    assert before is not None, "".join(lines)[-3000:]
    said = _check_torchrun_lines(lines, before, "Ctrl-C")
    assert all("the last checkpoint in " in m.string for m in said), said
    assert rc != 0     # torchrun's own status (its SignalException); each worker's is 130
    # the job dir says so, every PID file is gone, and the checkpoint is whole: resume=auto continues
    status = json.loads((job / "status.json").read_text())
    assert status["state"] == "interrupted" and status["round"] is None, status
    assert "interrupted on rank 0 (Ctrl-C)" in status["message"]
    assert os.listdir(job / "pids") == []
    from admm_dist.training.checkpoint import completed_rounds
    done = completed_rounds(str(tmp_path / "run.ckpt"), range(N))
    assert done and done[-1] >= 1, os.listdir(tmp_path / "run.ckpt")
    # (in this process, every node on one backbone: the checkpoint does not depend on the launch)
    from admm_dist.cli import train
    monkeypatch.setenv("ADMM_JOB_DIR", str(job))
    capfd.readouterr()
    assert train.main(_args(assets, tmp_path, resume="auto", k_outer=done[-1] + 1)) == 0
    assert f"continuing after round {done[-1]}" in capfd.readouterr().out
    assert json.loads((job / "status.json").read_text())["state"] == "finished"


@pytest.mark.slow    # not a Ctrl-C (that reaches every rank): a kill of one worker; ~5 s, 15 s on busy 2 cores
def test_a_rank_interrupted_alone_exits_130_and_its_peer_says_one_line(assets, tmp_path):
    """SIGINT to one worker only (by the PID it recorded): it says its line and exits 130 (the
    agent reports that status), its peer stops with one line of its own, no traceback of ours."""
    job = tmp_path / "job"
    run = Run(train_cmd(_args(assets, tmp_path), N), job)
    pid = None
    try:
        if run.wait_for("round   2/", time.time() + 120):
            whole = sorted(f for f in os.listdir(job / "pids") if f.endswith(".pid"))   # not a temporary
            with open(job / "pids" / whole[-1]) as fh:
                pid = int(json.load(fh))
            os.kill(pid, signal.SIGINT)
    finally:
        rc, lines = run.finish(timeout=90)
    text = "".join(lines)
    assert pid is not None, text[-3000:]
    said = [line for line in lines if ONE_LINE.match(line)]
    assert len(said) >= 1 and "(Ctrl-C)" in said[0], text[-3000:]
    assert re.search(rf"exitcode\s*: 130 \(pid: {pid}\)", text), text[-3000:]
    ours = [line for line in lines if line.startswith("admm_dist.train:")]
    assert len(ours) <= N, ours            # one line per rank (the peer's may be torchrun's SIGTERM)
    assert "[rank" not in text and not FRAME.search(text), text[-3000:]
    assert rc != 0


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_plain_python_stop_is_one_line_with_128_plus_signal_and_resume_auto_continues(
        assets, tmp_path, sig, capfd, monkeypatch):
    job = tmp_path / "job"
    run = Run(train_cmd(_args(assets, tmp_path), 1), job)
    before = None
    try:
        if run.wait_for("round   2/", time.time() + 120):   # round 1 is checkpointed
            before = run.signal_group(sig)
    finally:
        rc, lines = run.finish(timeout=60)
    text = "".join(lines)
    assert before is not None, text[-3000:]
    assert rc == 128 + sig, text[-3000:]
    after = [line for line in lines[before:] if not line.startswith("round ")]
    how = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert len(after) == 1 and after[0].startswith(
        f"admm_dist.train: interrupted on rank 0 ({how}): the last checkpoint in {tmp_path / 'run.ckpt'} is kept; "
        "rerun with resume=auto"), text[-3000:]
    assert "Traceback" not in text
    status = json.loads((job / "status.json").read_text())
    assert status["state"] == "interrupted" and os.listdir(job / "pids") == []
    from admm_dist.cli import train
    from admm_dist.training.checkpoint import completed_rounds
    done = completed_rounds(str(tmp_path / "run.ckpt"), range(N))
    assert done, os.listdir(tmp_path / "run.ckpt")
    monkeypatch.setenv("ADMM_JOB_DIR", str(job))
    capfd.readouterr()
    assert train.main(_args(assets, tmp_path, resume="auto", k_outer=done[-1] + 1)) == 0
    assert f"continuing after round {done[-1]}" in capfd.readouterr().out
    assert json.loads((job / "status.json").read_text())["state"] == "finished"


DEADLINE_SCRIPT = """
import datetime, sys
import torch.distributed as dist
from admm_dist.engine.preemption import Interrupted, StopSignals
stop = StopSignals(grace_s=1.0, on_deadline=lambda n: sys.stderr.write(f"deadline {n}\\n"))
undo = stop.install()
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=60))
said = False
while True:
    try:
        if not said:
            said = True
            print("waiting", flush=True)
        store.get("never set")  # in C++, where a signal cannot reach Python: a collective whose peer left
    except Interrupted:         # the signal came before the wait began: wait again
        pass
"""


def test_a_rank_stuck_where_a_signal_cannot_reach_python_still_leaves_within_the_grace(tmp_path):
    run = Run([sys.executable, "-c", DEADLINE_SCRIPT], tmp_path / "job")   # -c: this checkout's package
    try:
        assert run.wait_for("waiting", time.time() + 60), "".join(run.lines)
        t0 = time.time()
        run.signal_group(signal.SIGTERM)
    finally:
        rc, lines = run.finish(timeout=30)
    assert rc == 128 + signal.SIGTERM and "".join(lines).endswith(f"deadline {int(signal.SIGTERM)}\n"), lines
    assert 0.9 < time.time() - t0 < 20


def test_the_first_stop_signal_raises_once_and_later_ones_are_notes():
    """Under torchrun one Ctrl-C reaches a worker twice (the terminal's, then the agent's): the
    second must not cut the clean-up the first began. After hold() even the first is a note."""
    from admm_dist.engine.preemption import Interrupted, StopSignals

    stop = StopSignals()
    with pytest.raises(Interrupted) as e:
        stop.handle(signal.SIGINT)
    assert e.value.exit_code == 130 and isinstance(e.value, KeyboardInterrupt)
    stop.handle(signal.SIGINT)
    stop.handle(signal.SIGTERM)
    assert stop.signum == signal.SIGINT
    held = StopSignals()
    held.hold()
    held.handle(signal.SIGTERM)
    assert held.signum == signal.SIGTERM


def test_install_puts_back_the_handlers_and_the_wakeup_fd():
    from admm_dist.engine.preemption import StopSignals

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    stop = StopSignals()
    undo = stop.install()
    assert signal.getsignal(signal.SIGINT) == stop.handle and signal.getsignal(signal.SIGTERM) == stop.handle
    undo()
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.set_wakeup_fd(fd) == fd     # the one before, not ours
