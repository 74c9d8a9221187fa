"""Rows step in rotation, one at a time; their times, results and errors reach the main thread."""
import threading
import time

import pytest

from admm_dist.bench.interleave import Row, paired_ratios, rotate, summary


def _loop(name, log, steps, sleep=0.0, fail_at=None):
    def fn(baton):
        log.append((name, "built"))
        baton.ready()
        for k in range(steps):
            if k == fail_at:
                raise ValueError(f"{name} broke at step {k}")
            log.append((name, k, threading.current_thread().name))
            time.sleep(sleep)
            baton.step_done()
        return {"name": name}
    return fn


def test_rows_take_their_steps_in_rotation():
    log = []
    rows = [Row(n, _loop(n, log, 3, sleep=0.01 * (i + 1)), 3, timeout_s=30) for i, n in enumerate("abc")]
    rotate(rows)
    assert [e[0] for e in log] == ["a", "b", "c"] + ["a", "b", "c"] * 3
    assert log[:3] == [("a", "built"), ("b", "built"), ("c", "built")]
    assert [e[1] for e in log[3:]] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(e[2] == f"bench-{e[0]}" for e in log[3:])       # every row in its own thread
    for i, r in enumerate(rows):
        assert r.result == {"name": r.name} and len(r.times) == 3
        assert min(r.times) >= 0.01 * (i + 1)                    # the step's own work is in its time
        assert len(r.baton.cpu_times) == 3
    s = summary(rows[1], warmup=1)
    assert s["step_times_s"] == rows[1].times[1:] and s["warmup_times_s"] == rows[1].times[:1]
    assert "peak_gib" not in s                                   # CPU: no memory figures
    assert paired_ratios([2.0, 6.0], [1.0, 2.0]) == [2.0, 3.0]
    with pytest.raises(ValueError, match="as many steps"):
        paired_ratios([1.0], [1.0, 2.0])


def test_an_error_in_a_row_is_one_runtime_error_naming_it():
    log = []
    rows = [Row("ours", _loop("ours", log, 3), 3, timeout_s=30),
            Row("trl", _loop("trl", log, 3, fail_at=1), 3, timeout_s=30)]
    with pytest.raises(RuntimeError, match=r"^trl failed: ValueError: trl broke at step 1$"):
        rotate(rows)
    assert ("ours", 2, "bench-ours") not in log                  # the rotation stopped there


def test_a_row_that_makes_too_few_steps_is_refused():
    def short(baton):
        baton.ready()
        baton.step_done()
    with pytest.raises(RuntimeError, match="made 1 steps, expected 2"):
        rotate([Row("short", short, 2, timeout_s=30)])
    with pytest.raises(ValueError, match="same number of steps"):
        rotate([Row("a", short, 2), Row("b", short, 3)])
