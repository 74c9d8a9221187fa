"""The CPU launcher's forked workers start as spawned ones would: the caller's environment, working
directory, import path and stdout/stderr as they are at launch time, the launcher's own
variables (RANK, WORLD_SIZE, ...) the launcher's."""
import os
import sys

import torch.distributed as dist

from admm_dist.engine import launcher
from admm_dist.engine.launcher import launch_cpu


def _seen(ctx):
    print(f"worker {ctx.env.rank} says hello", file=sys.stderr, flush=True)
    return {"rank": dist.get_rank(), "RANK": os.environ["RANK"], "FOO": os.environ.get("FOO"),
            "GONE": os.environ.get("ADMM_TEST_GONE"), "cwd": os.getcwd(), "path": list(sys.path)}


def test_workers_see_the_callers_state_at_launch_time(tmp_path, monkeypatch, capfd):
    assert launcher._start_method(_seen) == "forkserver"
    monkeypatch.setenv("ADMM_TEST_GONE", "1")
    launch_cpu(_seen, 2, timeout_s=60)               # the fork server is running from here on
    monkeypatch.setenv("FOO", "changed after the server started")
    monkeypatch.delenv("ADMM_TEST_GONE")
    monkeypatch.setenv("RANK", "99")                 # the caller's RANK is not the workers'
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "extra"))
    capfd.readouterr()
    seen = launch_cpu(_seen, 2, timeout_s=60)
    for rank in (0, 1):
        s = seen[rank]
        assert s["rank"] == rank and s["RANK"] == str(rank)
        assert s["FOO"] == "changed after the server started" and s["GONE"] is None
        assert s["cwd"] == str(tmp_path) and s["path"][0] == str(tmp_path / "extra")
    err = capfd.readouterr().err
    assert "worker 0 says hello" in err and "worker 1 says hello" in err


def test_a_scripts_function_is_spawned():
    def script_fn(ctx):
        return None
    script_fn.__module__ = "__main__"
    assert launcher._start_method(script_fn) == "spawn"
