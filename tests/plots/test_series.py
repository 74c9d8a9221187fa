"""The plot command's inputs: a training report, an evaluation result and a benchmark summary,
recognised by content and read into series equal to the files' values; bad files are one-line
user errors; and this module never loads matplotlib.

``train_report`` (a small report of distinct values per field, node and round) is shared with
``test_figures.py``.
"""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
from conftest import REPO

from admm_dist.core.errors import UserError
from admm_dist.plots import series as S

NODE_FIELDS = ("f", "primal", "primal_normalized", "dual", "bytes_sent", "bytes_recv",
               "sec_x", "sec_z", "sec_other")
BENCH = REPO / "docs" / "bench_fidelity.json"


def value(field: str, node: int, round_: int):
    """A distinct positive value for every field, node and round (whole bytes)."""
    if field.startswith("bytes"):
        return 1024 * (40 + 10 * node + round_) * (2 if field == "bytes_recv" else 1)
    return round((1 + NODE_FIELDS.index(field)) * (1 + node) / (3.0 * round_ + 1), 6)


def train_report(nodes: int = 3, rounds: int = 4, dev: bool = True) -> dict:
    """A training report as the trainer writes it, ``nodes`` x ``rounds``."""
    report = {"config": {"fit_mode": "dpo", "out": "runs/tiny"}, "n_nodes": nodes,
              "rounds": [{"round": k, **{f: [value(f, i, k) for i in range(nodes)] for f in NODE_FIELDS},
                          "x1_norm": 0.1 * k, "rho": 0.5} for k in range(1, rounds + 1)]}
    if dev:
        report["dev_curve"] = [{"round": k, "dev_nll": 2.0 - 0.1 * k} for k in range(0, rounds + 1, 2)]
    return report


def eval_result(correct: int = 269, n: int = 400) -> dict:
    return {"task": "chain_arith", "split": "eval", "rows": [0, n], "n": n, "n_chains": n,
            "accuracy": correct / n, "correct": correct, "settings": {}}


def test_train_series_holds_the_report_per_node_per_round():
    report = train_report()
    s = S.train_series(report, "runs/x/tiny-train.json")
    assert (s.name, s.source, s.n_nodes, s.fit_mode) == ("tiny", "runs/x/tiny-train.json", 3, "dpo")
    assert s.rounds == [1, 2, 3, 4]
    for field in S.NODE_FIELDS:
        assert getattr(s, field) == [[r[field][i] for r in report["rounds"]] for i in range(3)], field
    assert s.dev_rounds == [0, 2, 4] and s.dev_nll == [p["dev_nll"] for p in report["dev_curve"]]


def test_a_null_value_is_nan_and_no_dev_curve_is_empty():
    report = train_report(dev=False)
    report["rounds"][1]["dual"][2] = None              # a non-finite value, as the writer stores it
    s = S.train_series(report, "tiny-train.json")
    assert math.isnan(s.dual[2][1]) and s.dev_rounds == [] and s.dev_nll == []


def test_kind_of_each_kind_and_of_junk():
    assert S.kind_of(train_report()) == "train"
    assert S.kind_of(eval_result()) == "eval"
    assert S.kind_of(json.loads(BENCH.read_text())) == "bench"
    for junk in ({}, [], "text", {"rounds": "x"}, {"rounds": [{"round": 1}]}, {"accuracy": 0.5},
                 {"modes": []}):
        assert S.kind_of(junk) is None, junk


def test_wilson_interval():
    lo, hi = S.wilson(269, 400)
    assert lo == pytest.approx(0.62506, abs=1e-5) and hi == pytest.approx(0.71666, abs=1e-5)
    assert S.wilson(0, 10)[0] == 0.0 and S.wilson(10, 10)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        S.wilson(3, 0)


def test_eval_point_has_the_accuracy_and_its_interval():
    p = S.eval_point(eval_result(), "results/after.json")
    assert (p.name, p.task, p.accuracy, p.correct, p.n) == ("after", "chain_arith", 0.6725, 269, 400)
    assert (p.lo, p.hi) == S.wilson(269, 400)


def test_bench_summary_puts_the_base_first_and_the_gain_ci_at_the_base():
    raw = json.loads(BENCH.read_text())
    b = S.bench_summary(raw, str(BENCH))
    assert b.seeds == len(raw["seeds"]) and b.eval_n == raw["eval_n"] and list(b.modes) == list(raw["modes"])
    for mode, arms in b.modes.items():
        table = raw["modes"][mode]
        assert [a.name for a in arms] == ["base"] + [n for n in table if n != "base"]
        assert b.base_mean(mode) == table["base"]["mean"] and arms[0].ci is None
        for a in arms[1:]:
            r = table[a.name]
            assert a.mean == r["mean"] and a.accuracy == r["accuracy"]
            assert a.ci == pytest.approx([r["mean"] - r["gain"] + c for c in r["gain_ci95"]])


def test_a_refused_arm_is_left_out():
    raw = copy.deepcopy(json.loads(BENCH.read_text()))
    raw["modes"]["greedy"]["ADMM-ring"]["refused"] = "out of memory"
    names = [a.name for a in S.bench_summary(raw, "b.json").modes["greedy"]]
    assert "ADMM-ring" not in names and "ADMM-gossip" in names


@pytest.mark.parametrize("content, words", [
    ('{"hello": 1}', "is none of a training report"),
    ("{not json", "is not valid JSON"),
    (None, "does not exist"),
])
def test_a_bad_input_is_a_one_line_user_error_naming_it(tmp_path, content, words):
    path = tmp_path / "in.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError) as err:
        S.load(str(path))
    assert words in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_report_missing_a_field_names_the_round_and_the_field():
    report = train_report()
    del report["rounds"][2]["dual"]
    with pytest.raises(UserError, match=r"round 3's 'dual' is not a list of 3 node values"):
        S.train_series(report, "tiny-train.json")


def test_series_and_the_command_module_do_not_load_matplotlib():
    code = ("import sys, admm_dist.plots.series, admm_dist.cli.plot; "
            "sys.exit('matplotlib' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, timeout=60).returncode == 0
