"""The figures hold the inputs' values: one line per node (or per run) whose points are the
report's, log axes where residuals are drawn (non-positive values masked), bars at the means;
and the PNG writer's size and metadata."""
from __future__ import annotations

import copy
import json
import math

import pytest
from conftest import REPO
from PIL import Image
from test_series import eval_result, train_report

from admm_dist.plots import figures as F
from admm_dist.plots import series as S

BENCH = REPO / "docs" / "bench_fidelity.json"


def series_of(report: dict, name: str = "tiny") -> S.TrainSeries:
    return S.train_series(report, f"runs/{name}-train.json")


def per_node(report: dict, field: str):
    return [[r[field][i] for r in report["rounds"]] for i in range(len(report["rounds"][0][field]))]


def assert_node_lines(ax, report: dict, field: str, divisor: float = 1.0) -> None:
    lines = ax.get_lines()
    assert [ln.get_label() for ln in lines] == [f"node {i}" for i in range(len(lines))]
    for ln, want in zip(lines, per_node(report, field), strict=True):
        assert [y * divisor for y in ln.get_ydata()] == pytest.approx(want)
    assert all(list(ln.get_xdata()) == [r["round"] for r in report["rounds"]] for ln in lines)


def test_residuals_are_two_log_panels_of_one_line_per_node():
    report = train_report()
    fig = F.residuals(series_of(report))
    assert len(fig.axes) == 2 and [ax.get_yscale() for ax in fig.axes] == ["log", "log"]
    for ax, field in zip(fig.axes, ("primal_normalized", "dual")):
        assert len(ax.get_lines()) == 3
        assert_node_lines(ax, report, field)


def test_non_positive_residuals_are_masked_not_drawn():
    report = train_report()
    report["rounds"][0]["dual"][1] = 0.0
    report["rounds"][3]["dual"][1] = -1e-9
    ys = list(F.residuals(series_of(report)).axes[1].get_lines()[1].get_ydata())
    assert math.isnan(ys[0]) and math.isnan(ys[3]) and ys[1:3] == [report["rounds"][k]["dual"][1] for k in (1, 2)]


def test_an_all_zero_residual_panel_keeps_a_valid_log_axis():
    report = train_report()
    for r in report["rounds"]:
        r["primal_normalized"] = [0.0] * 3           # one pooled run: x = z exactly
    ax = F.residuals(series_of(report)).axes[0]
    assert ax.get_yscale() == "log" and ax.get_ylim() == pytest.approx(F.LOG_FLOOR)


def test_objectives_are_f_per_node_and_the_dev_curve():
    report = train_report()
    fig = F.objectives(series_of(report))
    assert len(fig.axes) == 2
    assert_node_lines(fig.axes[0], report, "f")
    (dev,) = fig.axes[1].get_lines()
    assert list(dev.get_xdata()) == [p["round"] for p in report["dev_curve"]]
    assert list(dev.get_ydata()) == [p["dev_nll"] for p in report["dev_curve"]]
    assert len(F.objectives(series_of(train_report(dev=False))).axes) == 1


def test_bytes_are_sent_and_received_per_node_in_one_unit():
    report = train_report()
    fig = F.traffic(series_of(report))
    divisor, unit = F.byte_unit(max(max(r["bytes_recv"]) for r in report["rounds"]))
    assert unit == "KiB" and all(ax.get_ylabel().startswith("KiB per round") for ax in fig.axes)
    assert_node_lines(fig.axes[0], report, "bytes_sent", divisor)
    assert_node_lines(fig.axes[1], report, "bytes_recv", divisor)


def test_byte_unit():
    assert F.byte_unit(0) == (1.0, "B") and F.byte_unit(1023) == (1.0, "B")
    assert F.byte_unit(2048) == (1024.0, "KiB") and F.byte_unit(5 * 2 ** 20) == (2.0 ** 20, "MiB")


def test_comparisons_have_one_line_per_run():
    a, b = train_report(), train_report(nodes=2, rounds=3)
    for r in b["rounds"]:
        r["primal_normalized"][0] = 1.0
    runs = [series_of(a, "a"), series_of(b, "b")]
    ax = F.compare_residuals(runs).axes[0]
    assert ax.get_yscale() == "log" and [ln.get_label() for ln in ax.get_lines()] == ["a", "b"]
    assert [list(ln.get_ydata()) for ln in ax.get_lines()] == [
        [max(r["primal_normalized"]) for r in rep["rounds"]] for rep in (a, b)]
    ax = F.compare_objectives(runs).axes[0]
    for ln, rep in zip(ax.get_lines(), (a, b), strict=True):
        assert list(ln.get_ydata()) == pytest.approx([sum(r["f"]) / len(r["f"]) for r in rep["rounds"]])


def test_accuracy_bars_are_the_accuracies():
    points = [S.eval_point(eval_result(186), "before.json"), S.eval_point(eval_result(269), "after.json")]
    ax = F.accuracy(points).axes[0]
    assert [p.get_height() for p in ax.patches] == [0.465, 0.6725] and ax.get_ylim() == (0, 1)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["before", "after"]


def test_accuracy_by_arm_bars_are_the_means_and_refused_arms_are_left_out():
    raw = copy.deepcopy(json.loads(BENCH.read_text()))
    raw["modes"]["sampled"]["ADMM-gossip"]["refused"] = "out of memory"
    fig = F.accuracy_by_arm(S.bench_summary(raw, str(BENCH)))
    assert len(fig.axes) == len(raw["modes"])
    for ax, (mode, table) in zip(fig.axes, raw["modes"].items()):
        kept = [n for n in table if "refused" not in table[n]]
        assert [p.get_height() for p in ax.patches] == [table[n]["mean"] for n in kept]
        assert [t.get_text() for t in ax.get_xticklabels()] == kept
        assert ax.get_lines()[-1].get_ydata()[0] == table["base"]["mean"]    # the dashed base line
    assert "ADMM-gossip" not in [t.get_text() for t in fig.axes[1].get_xticklabels()]


def test_save_writes_a_png_of_the_declared_size_with_title_and_source(tmp_path):
    fig = F.residuals(series_of(train_report()))
    path = tmp_path / "sub" / "r.png"
    F.save(fig, str(path), "a title", "runs/tiny-train.json")
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == F.size_px(2)
        assert im.info["Title"] == "a title" and im.info["Source"] == "runs/tiny-train.json"
