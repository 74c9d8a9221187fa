"""A failure is one line, said once per job, and names the rank that went away where it can.

- A rank of a sharded seat that leaves in the middle of an x-step: its partner's FSDP gather
  fails in gloo, and the partner says one line naming it (exit 1), not the backend's traceback.
- A rank that stops (SIGSTOP) there: its partner's gather times out, and the line names it too.
- Under torchrun a typo in a key, which every rank finds alike, is said once; the workers the
  agent then stops say nothing, and no line advises a rerun.

The ranks run under :func:`admm_dist.bench.launcher.launch_cpu` (torch's elastic agent, as
torchrun runs it) but the typo, which runs under a real ``torchrun``. Every wait is bounded.
"""
import json
import os
import signal
import subprocess
import threading
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from admm_dist.bench.launcher import launch_cpu
from conftest import REPO, cli_rank, tiny_args, train_cmd

PROG = "admm_dist.train:"


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(1)


def _sharded(assets, tmp_path, **kw):
    """One seat over two ranks (k = 2), its backbone sharded between them."""
    return tiny_args(assets, **dict(dict(shard_backbone="true", micro_batches=2, k_outer=3, timeout_s=30,
                                         out=str(tmp_path / "run"), report_dir=str(tmp_path / "rep")), **kw))


def _rank1_leaves_at_its_first_step(argv, how):
    """Rank 1 of the launch leaves as its first x-step starts (``exit``: gone, its sockets
    closed; ``stop``: SIGSTOPped, its sockets open); rank 0 is the command as it is."""
    if os.environ["RANK"] == "1":
        from admm_dist.training.local_steps import LocalSteps

        def leave(*args, **kwargs):
            if how == "exit":
                os._exit(0)
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(60)    # let go: the SIGTERM the agent sent meanwhile ends it here
            raise AssertionError("the agent did not stop this rank")
        LocalSteps.run = leave
    return cli_rank(argv)


def _ours(err):
    return [line for line in err.splitlines() if line.startswith(PROG)]


def test_a_rank_of_a_sharded_seat_that_leaves_mid_step_is_one_line_naming_it(assets, tmp_path, capfd):
    capfd.readouterr()
    with pytest.raises(ChildFailedError) as failed:
        launch_cpu(_rank1_leaves_at_its_first_step, 2, _sharded(assets, tmp_path), "exit", timeout_s=60, setup=False)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "GLHF" not in err and "This is typically caused" not in err, err[-3000:]
    ours = _ours(err)
    assert len(ours) == 1, err[-3000:]
    # rank 0's first collective after rank 1 left is FSDP's gather of the first layer's weights
    assert ours[0].startswith(f"{PROG} error on rank 0: a collective between ranks failed (") and ours[0].endswith(
        "; rank 1 stopped answering (killed, stopped or cut off)"), ours
    assert {r: f.exitcode for r, f in failed.value.failures.items()} == {0: 1}, failed.value.failures


def test_a_rank_of_a_sharded_seat_that_stops_is_named_when_its_partner_times_out(assets, tmp_path, capfd,
                                                                                 monkeypatch):
    """timeout_s=3: rank 0's gather waits that long for the stopped rank 1, then says so in one
    line naming it; once rank 0 has written its status, rank 1 is let go (by its PID) and takes
    the SIGTERM the agent sent it meanwhile, silently."""
    job = tmp_path / "job"
    monkeypatch.setenv("ADMM_JOB_DIR", str(job))
    done = threading.Event()

    def let_go():   # SIGCONT to rank 1 once rank 0 has said its line (or at the deadline)
        deadline = time.time() + 90
        while time.time() < deadline and not done.is_set():
            try:
                if json.loads((job / "status.json").read_text())["state"] == "failed":
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        for name in os.listdir(job / "pids") if (job / "pids").is_dir() else []:
            if name.endswith("-rank1.pid"):
                try:
                    os.kill(int(json.loads((job / "pids" / name).read_text())), signal.SIGCONT)
                except (OSError, ValueError):
                    pass

    helper = threading.Thread(target=let_go, daemon=True)
    helper.start()
    capfd.readouterr()
    t0 = time.monotonic()
    try:
        with pytest.raises(ChildFailedError) as failed:
            launch_cpu(_rank1_leaves_at_its_first_step, 2, _sharded(assets, tmp_path, timeout_s=3), "stop",
                       timeout_s=60, setup=False)
    finally:
        done.set()
        helper.join(10)
    err = capfd.readouterr().err
    assert time.monotonic() - t0 < 60
    assert "Traceback" not in err, err[-3000:]
    ours = _ours(err)
    assert len(ours) == 1, err[-3000:]
    assert ours[0].startswith(f"{PROG} error on rank 0: a collective between ranks failed "
                              "(Timed out waiting 3000ms") \
        and ours[0].endswith("; rank 1 stopped answering (killed, stopped or cut off)"), ours
    assert failed.value.failures[0].exitcode == 1, failed.value.failures
    status = json.loads((job / "status.json").read_text())
    assert status["state"] == "failed" and status["message"] == ours[0][len(f"{PROG} error on rank 0: "):], status


def test_a_typo_under_torchrun_is_said_once_and_no_line_advises_a_rerun(tmp_path):
    """Every rank finds the typo alike: the first to find it says it, the others say nothing (or
    are stopped by the agent while they start, silently). The rest is torchrun's own summary."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = train_cmd([f"out={tmp_path / 'run'}", "k_outr=2"], 2)   # two ranks: one says it, one is silent
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=30)
    ours = _ours(out)
    assert ours == [f"{PROG} error: unknown key 'k_outr' in the command line (did you mean 'k_outer'?): "
                    "valid keys are listed by --help"], out[-3000:]
    assert "rerun" not in out, out[-3000:]
    assert p.returncode == 1, out[-3000:]     # torchrun's own status, after its summary (a worker's is 2)
    assert "exitcode  : 2" in out, out[-3000:]
