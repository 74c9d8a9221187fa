"""The figures: one function per picture (a series in, a matplotlib ``Figure`` out), the PNG
writer :func:`save`, and :func:`draw_all`, which the plot command calls.

Figures are built on the Agg canvas directly (no pyplot: no global backend, no window, nothing
to close). Every figure is ``PANEL`` inches per panel, panels side by side, at ``DPI``, so a
PNG of ``p`` panels is :func:`size_px` ``(p)`` pixels. Every PNG carries a ``Title`` and a
``Source`` (the input path or paths) in its metadata.

This module is imported only by the plot command (it imports matplotlib at load).
"""
from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Sequence

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from admm_dist.core.errors import UserError
from admm_dist.core.io import atomic_write_bytes
from admm_dist.core.text import size_unit
from admm_dist.plots.series import (
    BASE_ARM,
    ArmBars,
    BenchSummary,
    EvalPoint,
    PerNode,
    Series,
    TrainSeries,
    bench_summary,
    load,
)

DPI = 110
PANEL = (5.0, 4.0)               # inches, one panel; panels are side by side
MARKERS_UP_TO = 40               # rounds: fewer get a marker on every point
LOG_FLOOR = (1e-3, 1.0)          # the y range of a log panel with nothing positive to show


def figure_size(panels: int) -> tuple[float, float]:
    return PANEL[0] * panels, PANEL[1]


def size_px(panels: int) -> tuple[int, int]:
    """The pixel size of a saved figure of ``panels`` panels."""
    width, height = figure_size(panels)
    return round(width * DPI), round(height * DPI)


def new_figure(panels: int, title: str) -> tuple[Figure, list[Axes]]:
    """A figure of ``panels`` panels side by side, titled ``title`` (also its label)."""
    fig = Figure(figsize=figure_size(panels), dpi=DPI, label=title)
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=11)
    return fig, [fig.add_subplot(1, panels, i + 1) for i in range(panels)]


def save(fig: Figure, path: str, title: str, source: str) -> None:
    """Write ``fig`` as a PNG at ``path`` (atomically), with ``Title`` and ``Source`` metadata."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Title": title, "Source": source})
    atomic_write_bytes(path, buf.getvalue())


# ---------------------------------------------------------------------------- shared pieces
def positive(values: Sequence[float]) -> list[float]:
    """``values`` with every non-positive (or NaN) value masked as NaN, for a log axis."""
    return [v if v > 0 else math.nan for v in values]


def byte_unit(largest: float) -> tuple[float, str]:
    """(divisor, unit name) that shows ``largest`` bytes as a number below 1024."""
    unit, scale = size_unit(largest)
    return float(scale), unit


def per_round(table: PerNode, reduce: Callable[[list[float]], float]) -> list[float]:
    """``reduce`` over the nodes at each round, NaNs left out (NaN where every node is NaN)."""
    out = []
    for column in zip(*table):
        finite = [v for v in column if not math.isnan(v)]
        out.append(reduce(finite) if finite else math.nan)
    return out


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def style(rounds: Sequence[int]) -> dict[str, object]:
    return {"marker": "o", "ms": 3} if len(rounds) <= MARKERS_UP_TO else {}


def round_axis(ax: Axes, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("ADMM round k")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)


def log_axis(ax: Axes, rounds: Sequence[int], tables: Sequence[Sequence[float]]) -> None:
    """Log y; a panel with no positive value says so (over its rounds) instead of breaking."""
    ax.set_yscale("log")
    if not any(v > 0 for row in tables for v in row):
        ax.set_ylim(*LOG_FLOOR)
        ax.set_xlim(min(rounds) - 0.5, max(rounds) + 0.5)
        ax.text(0.5, 0.5, "no positive values:\nnothing to show on a log scale",
                transform=ax.transAxes, ha="center", va="center", fontsize=8, color="gray")


def legend(ax: Axes, entries: int) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=1 if entries <= 6 else 2)


def node_lines(ax: Axes, rounds: list[int], table: PerNode, *, log: bool = False,
               divisor: float = 1.0) -> None:
    """One line per node (``node 0``, ``node 1``, ...) against the round numbers."""
    for i, values in enumerate(table):
        ys = positive(values) if log else [v / divisor for v in values]
        ax.plot(rounds, ys, label=f"node {i}", color=f"C{i % 10}", lw=1.2, **style(rounds))
    if log:
        log_axis(ax, rounds, table)
    legend(ax, len(table))


def objective_label(s: TrainSeries) -> str:
    what = f"{s.fit_mode.upper()} loss" if s.fit_mode else "loss"
    return f"$f_i$ ({what}, nats)"


# ---------------------------------------------------------------------------- one training run
def objectives(s: TrainSeries) -> Figure:
    """f_i per node against the round; the held-out NLL of z beside it when the run has one."""
    with_dev = bool(s.dev_rounds)
    fig, axes = new_figure(2 if with_dev else 1, f"{s.name}: local objectives"
                           + (" and held-out NLL" if with_dev else ""))
    node_lines(axes[0], s.rounds, s.f)
    round_axis(axes[0], "local objective $f_i(x_i)$ of each node", objective_label(s))
    if with_dev:
        ax = axes[1]
        ax.plot(s.dev_rounds, s.dev_nll, color="k", lw=1.2, label="consensus z", **style(s.dev_rounds))
        round_axis(ax, "held-out NLL of the consensus z", "NLL (nats per target token)")
        legend(ax, 1)
    fig.tight_layout()
    return fig


def residuals(s: TrainSeries) -> Figure:
    """Normalized primal and dual residual per node, log y."""
    fig, (primal, dual) = new_figure(2, f"{s.name}: ADMM residuals per node")
    node_lines(primal, s.rounds, s.primal_normalized, log=True)
    round_axis(primal, r"normalized primal residual $\|x_i - z_i\| \,/\, \|z_i\|$",
               "relative residual (unitless, log)")
    node_lines(dual, s.rounds, s.dual, log=True)
    round_axis(dual, r"dual residual $\rho\,\|z_i^k - z_i^{k-1}\|$",
               r"$\rho$-scaled parameter-vector norm (log)")
    fig.tight_layout()
    return fig


def traffic(s: TrainSeries) -> Figure:
    """Bytes sent and received per round per node, in one readable unit."""
    largest = max((v for row in s.bytes_sent + s.bytes_recv for v in row if not math.isnan(v)),
                  default=0.0)
    divisor, unit = byte_unit(largest)
    fig, axes = new_figure(2, f"{s.name}: communication per round")
    for ax, table, what in zip(axes, (s.bytes_sent, s.bytes_recv), ("sent", "received")):
        node_lines(ax, s.rounds, table, divisor=divisor)
        round_axis(ax, f"bytes {what} by each node per round", f"{unit} per round"
                   + (" (1 KiB = 1024 B)" if unit != "B" else ""))
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------- several runs
def compare_residuals(runs: Sequence[TrainSeries]) -> Figure:
    """Per run, the worst node's normalized primal residual against the round, log y."""
    fig, (ax,) = new_figure(1, "Runs compared: normalized primal residual, worst node")
    worst = [per_round(s.primal_normalized, max) for s in runs]
    for j, (s, ys) in enumerate(zip(runs, worst)):
        ax.plot(s.rounds, positive(ys), label=s.name, color=f"C{j % 10}", lw=1.2, **style(s.rounds))
    log_axis(ax, [k for s in runs for k in s.rounds], worst)
    round_axis(ax, r"per run, the largest $\|x_i - z_i\| \,/\, \|z_i\|$ over its nodes",
               "relative residual (unitless, log)")
    legend(ax, len(runs))
    fig.tight_layout()
    return fig


def compare_objectives(runs: Sequence[TrainSeries]) -> Figure:
    """Per run, the mean over nodes of f_i against the round."""
    fig, (ax,) = new_figure(1, "Runs compared: mean local objective over nodes")
    for j, s in enumerate(runs):
        ax.plot(s.rounds, per_round(s.f, mean), label=s.name, color=f"C{j % 10}", lw=1.2,
                **style(s.rounds))
    modes = {s.fit_mode for s in runs}
    label = objective_label(runs[0]) if len(modes) == 1 else "$f_i$ (loss, nats)"
    round_axis(ax, "per run, the mean of $f_i(x_i)$ over its nodes", f"mean {label}")
    legend(ax, len(runs))
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------- accuracies
def accuracy(points: Sequence[EvalPoint]) -> Figure:
    """One bar per evaluation, its 95% Wilson interval as an error bar, the value on the bar."""
    fig, (ax,) = new_figure(1, "Accuracy with 95% Wilson intervals")
    xs = range(len(points))
    heights = [p.accuracy for p in points]
    yerr = [[max(0.0, p.accuracy - p.lo) for p in points], [max(0.0, p.hi - p.accuracy) for p in points]]
    bars = ax.bar(xs, heights, color="C0", alpha=0.8, yerr=yerr, capsize=5, ecolor="k")
    ax.bar_label(bars, [f"{p.accuracy:.3f}\n{p.correct}/{p.n}" for p in points],
                 label_type="center", fontsize=8, color="white")
    ax.set_xticks(list(xs), [p.name for p in points], rotation=20 if len(points) > 3 else 0,
                  ha="right" if len(points) > 3 else "center", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy (fraction of chains correct)")
    ax.set_title(f"task: {', '.join(sorted({p.task for p in points}))}", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def accuracy_by_arm(b: BenchSummary) -> Figure:
    """Per mode a panel: a bar per arm at its mean over seeds, the seeds as points, the gain's
    95% CI around the bar top, a dashed line at the base's mean."""
    rows = f", {b.eval_n} eval rows each" if b.eval_n else ""
    fig, axes = new_figure(len(b.modes), f"Accuracy by arm: mean over {b.seeds} seeds{rows}")
    for ax, (mode, arms) in zip(axes, b.modes.items()):
        arm_panel(ax, mode, arms)
    axes[0].legend(handles=[Patch(color="C0", alpha=0.8, label="mean over seeds"),
                            Line2D([], [], color="k", marker="o", ls="", ms=3, label="one seed"),
                            Line2D([], [], color="C3", label="95% CI of the gain over base"),
                            Line2D([], [], color="gray", ls="--", label="base mean")],
                   fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def arm_panel(ax: Axes, mode: str, arms: list[ArmBars]) -> None:
    """One mode's panel of :func:`accuracy_by_arm` (the base is ``arms[0]``)."""
    for i, arm in enumerate(arms):
        ax.bar(i, arm.mean, color="lightgray" if arm.name == BASE_ARM else "C0", alpha=0.8)
        ax.scatter([i] * len(arm.accuracy), arm.accuracy, color="k", s=10, zorder=3)
        if arm.ci is not None:
            lo, hi = arm.ci
            ax.errorbar([i], [arm.mean], yerr=[[max(0.0, arm.mean - lo)], [max(0.0, hi - arm.mean)]],
                        color="C3", capsize=4, lw=1.5, zorder=4)
    ax.axhline(arms[0].mean, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(arms)), [a.name for a in arms], rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy (fraction of chains correct)")
    ax.set_title(f"{mode} decoding", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)


def bench_overview(summary: dict, arm_names: Sequence[str], title: str) -> Figure:
    """The learning benchmark's own figure (``python -m benchmarks.fidelity --png``): per
    mode the accuracy by arm, then every arm's mean f over seeds and worst-seed normalized
    primal residual per round, from the benchmark's summary dict."""
    modes = list(summary["modes"])
    fig, axes = new_figure(len(modes) + 2, title)
    for ax, (mode, arms) in zip(axes, bench_summary(summary, "").modes.items()):
        arm_panel(ax, mode, [a for a in arms if a.name == BASE_ARM or a.name in arm_names])
    for ax, key, what in ((axes[-2], "f", "local objective f_i (mean over nodes), mean over seeds"),
                          (axes[-1], "primal_normalized", "max normalized primal residual, worst seed")):
        for j, name in enumerate(arm_names):
            runs = [r for r in summary["arms"][name][key] if r]
            if not runs:
                continue
            node = mean if key == "f" else max
            seeds = [[node(row) for row in run] for run in runs]
            agg = [(mean if key == "f" else max)(list(col)) for col in zip(*seeds)]
            ax.plot(range(1, len(agg) + 1), agg if key == "f" else positive(agg), color=f"C{j}", label=name,
                    **style(agg))
        round_axis(ax, what, "f_i" if key == "f" else "||x_i - z_i|| / ||z_i|| (log)")
        if key != "f":
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def learning_curve(summary: dict, title: str) -> Figure:
    """Greedy accuracy against the number of collections (0: the base), one line per consensus
    arm at its mean over seeds, with the 95% interval of its gain (shifted onto the accuracy
    axis) as a band, from the benchmark's ``curves`` (``recollect_every`` runs only)."""
    curves = summary.get("curves") or {}
    if not curves:
        raise UserError("the summary has no learning curve: run the benchmark with recollect_every=N")
    fig, (ax,) = new_figure(1, title)
    for j, (name, c) in enumerate(curves.items()):
        base = c["base"]
        xs = [0] + [p["collections"] for p in c["points"]]
        ys = [base] + [p["mean"] for p in c["points"]]
        lo = [base] + [base + p["gain_ci95"][0] for p in c["points"]]
        hi = [base] + [base + p["gain_ci95"][1] for p in c["points"]]
        ax.plot(xs, ys, color=f"C{j}", marker="o", label=name)
        ax.fill_between(xs, lo, hi, color=f"C{j}", alpha=0.2)
        for p in c["points"]:
            ax.scatter([p["collections"]] * len(p["accuracy"]), p["accuracy"], color=f"C{j}", s=8, alpha=0.6)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("collections trained on (0: the base chain)")
    ax.set_ylabel("greedy accuracy on the held-out rows")
    ax.set_title("mean over seeds; band: 95% CI of the gain; points: seeds", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------- the command
Job = tuple[str, Callable[[], Figure], str]       # (file name, figure, source)


def jobs(loaded: Sequence[Series]) -> list[Job]:
    """What to draw from the inputs, in order: per run its three figures, the comparisons,
    the accuracies, the benchmark."""
    runs = [s for s in loaded if isinstance(s, TrainSeries)]
    points = [s for s in loaded if isinstance(s, EvalPoint)]
    benches = [s for s in loaded if isinstance(s, BenchSummary)]
    out: list[Job] = []
    for s in runs:
        out += [(f"{s.name}-objectives.png", lambda s=s: objectives(s), s.source),
                (f"{s.name}-residuals.png", lambda s=s: residuals(s), s.source),
                (f"{s.name}-bytes.png", lambda s=s: traffic(s), s.source)]
    if len(runs) > 1:
        sources = "; ".join(s.source for s in runs)
        out += [("compare-residuals.png", lambda: compare_residuals(runs), sources),
                ("compare-objectives.png", lambda: compare_objectives(runs), sources)]
    if points:
        out.append(("accuracy.png", lambda: accuracy(points), "; ".join(p.source for p in points)))
    out += [("accuracy-by-arm.png", lambda b=b: accuracy_by_arm(b), b.source) for b in benches]
    return out


def check_names(todo: Sequence[Job]) -> None:
    seen: dict[str, str] = {}
    for name, _, source in todo:
        if name in seen:
            raise UserError(f"{source} and {seen[name]} would both write {name}: plot them in "
                            f"separate calls with different --out folders, or rename one")
        seen[name] = source


def draw_all(inputs: Sequence[str], out_dir: str) -> list[str]:
    """Read every input (all are checked before anything is drawn), draw, write the PNGs into
    ``out_dir`` (created if missing); the paths written, in order."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out {out_dir} is a file: name a folder (it is created if missing)")
    todo = jobs([load(p) for p in inputs])
    check_names(todo)
    written = []
    for name, draw, source in todo:
        fig = draw()
        path = os.path.join(out_dir, name)
        save(fig, path, str(fig.get_label()), source)
        written.append(path)
    return written


# ---------------------------------------------------------------------------- benchmarks
def links(records: Sequence[dict], *, rate: str, mib: float, nodes: Sequence[int], modes: Sequence[str],
          payloads: Sequence[str]) -> Figure:
    """``python -m benchmarks.links``: seconds per z-step against N, one line per mode and
    payload (solid fp32, dashed int8, dotted fp8, dash-dot int4), at one link rate and vector size."""
    fig, (ax,) = new_figure(1, f"{mib:g} MiB vectors at {rate} per link")
    dashes = {"none": "-", "int8": "--", "fp8": ":", "int4": "-."}
    colours = {m: f"C{i}" for i, m in enumerate(modes)}
    for mode in modes:
        for c in payloads:
            pts = sorted((x["n"], x["seconds"]) for x in records
                         if (x["rate"], x["mib"], x["mode"], x["compress"]) == (rate, mib, mode, c))
            if pts:
                ax.plot(*zip(*pts), dashes.get(c, "-"), color=colours[mode], marker="o", label=f"{mode} {c}")
    ax.set_xlabel("N (ranks, one per namespace)")
    ax.set_ylabel("seconds per z-step")
    ax.set_xticks(list(nodes))
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig
