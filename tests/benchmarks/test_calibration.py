"""The plan against measurement (benchmarks/calibration.py): the stand-in's rows, k = 1, 2 and 4
ranks per seat, whole and sharded, each rank's tensor bytes per category within 10% of the plan's
and its peak resident set over its baseline within 20% of the plan's peak; with the backbone
sharded, not yet: within a fixed excess (docs/benchmarks.md) (slow: 26 real ranks, about a minute and a
half on 2 cores). The comparison's own rules are checked on made-up figures (fast)."""
import json
import subprocess
import sys

import pytest

from benchmarks import calibration as cal
from admm_dist.training.rehearsal import CATEGORIES, RankPlan

from conftest import REPO


def _plan(memory, peak):
    return RankPlan(0, "seat", 2, 1, False, memory, peak, {}, 0.0)


def test_a_row_is_in_bounds_only_when_every_category_and_the_peak_are():
    memory = dict.fromkeys(CATEGORIES, 0) | {"backbone": 10 << 20, "activations": 40 << 20, "lora": 1000}
    measured = {"memory": dict(memory), "peak": 50 << 20, "rss_base": 300 << 20, "rss_peak": 355 << 20}
    row = cal.compare(_plan(memory, 50 << 20), measured)
    assert row["ok"] and row["category_err"] == 0 and row["peak_err"] == pytest.approx(-5 / 55)
    # a category 11% off is out; one under the floor is measured against the floor
    wrong = memory | {"activations": int(40.5 * 2**20) + (4 << 20)}
    off = cal.compare(_plan(wrong, 50 << 20), measured)
    assert not off["ok"] and off["category"] == "activations"
    small = cal.compare(_plan(memory | {"lora": 1000 + cal.FLOOR // 20}, 50 << 20), measured)
    assert small["ok"] and small["category"] == "lora"
    assert small["category_err"] == (cal.FLOOR // 20) / cal.FLOOR
    # a resident peak 30% over the plan's is out
    over = measured | {"rss_peak": (300 << 20) + int(50 * 1.3 * 2**20)}
    assert not cal.compare(_plan(memory, 50 << 20), over)["ok"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_stand_ins_plan_holds_against_its_real_ranks_at_every_k(tmp_path):
    out = tmp_path / "calibration.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.calibration", "--models", "standin",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=540)
    assert r.returncode in (0, 1) and out.exists(), r.stdout[-3000:] + r.stderr[-3000:]   # 1: a row out
    rows = json.loads(out.read_text())
    assert [(x["k"], x["sharded"], x["kind"]) for x in rows] == [
        (1, False, "seat"), (2, False, "leader"), (2, False, "follower"), (2, True, "leader"),
        (2, True, "follower"), (4, False, "leader"), (4, False, "follower"), (4, True, "leader"),
        (4, True, "follower")]
    for x in rows:
        for c, (plan, got) in x["categories"].items():
            # what a gloo thread may still hold a moment after the wait returns: a consensus piece, or
            # the seat group's all-gather of the reference log-probs ([k, n]: 12 KiB of the stand-in's
            # seen once in a loaded CI run, at k = 4)
            slack = {"consensus": cal.IN_FLIGHT, "reference": x["k"] * plan if x["k"] > 1 else 0}.get(c, 0)
            assert abs(plan - got) <= cal.CATEGORY_BOUND * max(got, cal.FLOOR) + slack, (c, x)
        if not x["sharded"]:
            assert abs(x["peak_err"]) <= cal.PEAK_BOUND, x
        else:   # not yet: a sharded stand-in rank holds 10-21 MiB that no tensor accounts for
            assert 0 < x["rss_peak"] - x["plan_peak"] < cal.SHARDED_EXCESS, x   # docs/benchmarks.md
    assert rows[-1]["counted_peak"] < rows[0]["counted_peak"]   # a seat's micro-batches spread over its ranks
    assert "| standin | 4 | sharded | follower |" in r.stdout
