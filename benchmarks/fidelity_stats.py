"""The statistics and the summary of the learning benchmark (``python -m benchmarks.fidelity``).

It owns how the per-seed results become figures: :func:`crossed_bootstrap` (the 95% interval
resampling seeds and rows), :func:`t_interval` (over seeds only), :func:`summarize` (the
benchmark's JSON: per arm and mode the accuracy, gain and intervals, and each arm's training
traces) and :func:`format_table` (the printed table); the PNG figure is
:func:`admm_dist.plots.figures.bench_overview`.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

from benchmarks.fidelity_run import ARM_BY_NAME, BASE, REFERENCE, BenchError, base_config

SINGLE = "base 1 seat"   # the untrained model alone (one seat, no chain), greedy on the chain's rows


def crossed_bootstrap(d, boot: int, seed: int = 0):
    """95% percentile interval of the mean of d[s, r] resampling seeds and rows independently."""
    import numpy as np

    d = np.asarray(d, dtype=np.float64)
    S, R = d.shape
    rng = np.random.default_rng(seed)
    means = np.empty(boot)
    for b in range(boot):
        rs = rng.integers(0, R, R)
        if S > 1:
            ss = rng.integers(0, S, S)
            means[b] = d[ss][:, rs].mean()
        else:
            means[b] = d[0, rs].mean()
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (then the normal's)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)


def t_interval(values: Sequence[float]):
    """95% t-interval of the mean of per-seed values (None with one seed)."""
    n = len(values)
    if n < 2:
        return None
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    h = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * sd / math.sqrt(n)
    return [m - h, m + h]


def summarize(args, base: dict, seeds: List[dict]) -> Dict[str, object]:
    """The benchmark's JSON: per arm and mode, per-seed accuracy, mean, gain and intervals."""
    modes = [m for m in ("greedy", "sampled") if m in base["rows"]]
    out: Dict[str, object] = {"modes": {}, "arms": {}, "seeds": [s["seed"] for s in seeds],
                              "versus": args.versus}
    for mode in modes:
        b = base["rows"][mode]
        table = {BASE: {"accuracy": [sum(b) / len(b)] * len(seeds), "mean": sum(b) / len(b)}}
        rows_of = {}
        for name in args.arm_list:
            per = [s["arms"][name] for s in seeds]
            if any(p.get("refused") for p in per):
                table[name] = {"refused": {str(s["seed"]): s["arms"][name]["refused"] for s in seeds
                                           if s["arms"][name].get("refused")}}
                continue
            for p in per:
                if p["rows"][mode + "_anchors"] != base["rows"][mode + "_anchors"]:
                    raise BenchError(f"{name}: evaluated on other rows than the base: rerun without --reuse")
            rows = [p["rows"][mode] for p in per]
            rows_of[name] = rows
            d = [[y - x for y, x in zip(r, b)] for r in rows]
            gains = [sum(r) / len(r) for r in d]
            acc = [sum(r) / len(r) for r in rows]
            table[name] = {"accuracy": acc, "mean": sum(acc) / len(acc),
                           "gain": sum(gains) / len(gains), "gain_per_seed": gains,
                           "gain_ci95": list(crossed_bootstrap(d, args.boot)),
                           "gain_ci95_seeds_t": t_interval(gains),
                           "wins": sum(g > 0 for g in gains)}
        versus = args.versus
        if versus in rows_of:
            ref = rows_of[versus]
            for name, rows in rows_of.items():
                if name == versus:
                    continue
                d = [[y - x for y, x in zip(r, q)] for r, q in zip(rows, ref)]
                diff = [sum(r) / len(r) for r in d]
                table[name]["minus_ref"] = sum(diff) / len(diff)
                table[name]["minus_ref_ci95"] = list(crossed_bootstrap(d, args.boot, seed=1))
        single = base.get("single") if mode == "greedy" else None
        if single:
            if single["greedy_anchors"] != base["rows"]["greedy_anchors"]:
                raise BenchError("the single seat was evaluated on other rows than the chain: rerun without "
                                 "--reuse")
            s1 = single["greedy"]
            table[SINGLE] = {"accuracy": [sum(s1) / len(s1)] * len(seeds), "mean": sum(s1) / len(s1)}
            for name, rows in rows_of.items():
                d = [[y - x for y, x in zip(r, s1)] for r in rows]
                table[name]["minus_single"] = sum(map(sum, d)) / sum(map(len, d))
                table[name]["minus_single_ci95"] = list(crossed_bootstrap(d, args.boot, seed=7))
        out["modes"][mode] = table
    for name in args.arm_list:
        per = [s["arms"][name] for s in seeds]
        out["arms"][name] = {
            "train_sec": [p.get("train_sec") for p in per],
            "refused": [p.get("refused") for p in per],
            "delta_w_rel": [p.get("delta_w_rel") for p in per],
            "node_sizes": [p.get("node_sizes") for p in per],
            "distance_to_centralized": [p.get("distance_to_centralized") for p in per],
            "f": [p.get("f") for p in per], "primal_normalized": [p.get("primal_normalized") for p in per],
            # per seed, each collection's mean pass rate (the chain's training-query accuracy
            # under the adapter it was collected with)
            "pass_rates": [[c.get("mean_pass_rate") for c in p.get("collections") or []] for p in per],
        }
    out["collection"] = [next((a.get("collection") for a in s["arms"].values() if a.get("collection")), None)
                         for s in seeds]
    curves = {name: _curve(args, base, [s["arms"][name] for s in seeds], name) for name in args.arm_list}
    out["curves"] = {name: c for name, c in curves.items() if c}
    return out


def _curve(args, base: dict, per: List[dict], name: str) -> Dict[str, object]:
    """A consensus arm's greedy accuracy at the rounds its curve was read (empty when it collected
    once or was refused): per point the collections trained on by then (the arm collects every
    ``recollect_every`` rounds), the per-seed accuracy, the mean gain over the base and its
    crossed-bootstrap interval."""
    if not all(p.get("curve") for p in per):
        return {}
    every = base_config(args, 0, ARM_BY_NAME[name]).recollect_every
    rounds = per[0]["curve"]["rounds"]
    b = base["rows"]["greedy"][:len(per[0]["curve"]["greedy"][0])]   # the curve reads the front rows
    points = []
    for i, k in enumerate(rounds):
        rows = [p["curve"]["greedy"][i] for p in per]
        d = [[y - x for y, x in zip(r, b)] for r in rows]
        acc = [sum(r) / len(r) for r in rows]
        points.append({"round": k, "collections": (k - 1) // every + 1, "accuracy": acc,
                       "mean": sum(acc) / len(acc),
                       "gain": sum(sum(r) / len(r) for r in d) / len(d),
                       "gain_ci95": list(crossed_bootstrap(d, args.boot, seed=2 + i))})
    return {"base": sum(b) / len(b), "rows": len(b), "points": points}


def _name_width(names) -> int:
    """The arm column: wide enough for the longest name, so every row's figures line up."""
    return max([12, *(len(n) for n in names)]) + 1


def format_table(summary: Dict[str, object], args) -> str:
    lines = []
    seeds = summary["seeds"]
    w = _name_width([BASE, *args.arm_list])
    versus = summary.get("versus", REFERENCE)
    vs = "vs " + ("ring" if versus == REFERENCE else versus)
    vw = max(9, len(vs) + 2)
    for mode, table in summary["modes"].items():
        how = "greedy" if mode == "greedy" else f"sampled, {args.samples} chains a row"
        n = args.eval_n if mode == "greedy" else args.sampled_n
        lines.append(f"\n{mode} accuracy on {n} held-out rows ({how}); gain = arm - base, "
                     f"95% CI over seeds and rows")
        head = f"{'arm':<{w}}" + "".join(f"{'s' + str(s):>7}" for s in seeds) + \
            f"{'mean':>8}{'gain':>8}{'95% CI':>18}{'wins':>6}{vs:>{vw}}{'95% CI':>18}"
        lines.append(head)
        for name in [BASE] + list(args.arm_list):
            r = table.get(name)
            if r is None:
                continue
            if "refused" in r:
                lines.append(f"{name:<{w}} refused on seed(s) {', '.join(r['refused'])}: "
                             f"{next(iter(r['refused'].values()))[:80]}")
                continue
            row = f"{name:<{w}}" + "".join(f"{a:7.3f}" for a in r["accuracy"]) + f"{r['mean']:8.3f}"
            if "gain" in r:
                lo, hi = r["gain_ci95"]
                row += f"{r['gain']:+8.3f}{f'[{lo:+.3f}, {hi:+.3f}]':>18}{r['wins']:>4}/{len(seeds)}"
                if "minus_ref" in r:
                    lo, hi = r["minus_ref_ci95"]
                    row += f"{r['minus_ref']:+{vw}.3f}{f'[{lo:+.3f}, {hi:+.3f}]':>18}"
            lines.append(row)
        if SINGLE in table:
            lines.append(f"\nthe untrained model alone ({SINGLE}) on the same rows, greedy: "
                         f"{table[SINGLE]['mean']:.3f}; each arm minus it, paired per row, 95% CI over seeds "
                         "and rows")
            for name in args.arm_list:
                r = table.get(name) or {}
                if "minus_single" in r:
                    lo, hi = r["minus_single_ci95"]
                    lines.append(f"{name:<{w}}{r['minus_single']:+8.3f}{f'[{lo:+.3f}, {hi:+.3f}]':>18}")
    lines += _pass_rate_lines(summary, args, w)
    lines += _curve_lines(summary, w)
    return "\n".join(lines)


def _curve_lines(summary: Dict[str, object], w: int) -> List[str]:
    """The learning curve: each consensus arm's greedy gain at the end of the rounds of
    benchmarks.fidelity_run.curve_rounds (each cell after the round its column names)."""
    curves = summary.get("curves") or {}
    if not curves:
        return []
    rounds = sorted({p["round"] for c in curves.values() for p in c["points"]})
    n = next(iter(curves.values())).get("rows")
    on = f" on the front {n} rows" if n else ""
    lines = [f"\ngreedy gain over the base along training{on} (mean over seeds, 95% CI over seeds and rows)",
             f"{'arm':<{w}}" + "".join(f"{f'after round {r}':>24}" for r in rounds)]
    for name, c in curves.items():
        at = {p["round"]: p for p in c["points"]}
        cells = []
        for r in rounds:
            p = at.get(r)
            lo, hi = p["gain_ci95"] if p else (0.0, 0.0)
            cells.append((f"{p['gain']:+7.3f} [{lo:+.3f}, {hi:+.3f}]" if p else "-").rjust(24))
        lines.append(f"{name:<{w}}" + "".join(cells))
    return lines


def _pass_rate_lines(summary: Dict[str, object], args, w: int) -> List[str]:
    """Each arm's collections' pass rates (mean over seeds), when some arm collected again."""
    arms = summary.get("arms", {})
    rates = {name: arms[name].get("pass_rates") or [] for name in args.arm_list if name in arms}
    most = max((len(r) for per in rates.values() for r in per if r), default=0)
    if most < 2:
        return []
    lines = ["\ncollections' pass rates on their training queries (mean over seeds; collection 0 is "
             "shared, later ones ran under the arm's own adapter)",
             f"{'arm':<{w}}" + "".join(f"{'c' + str(c):>8}" for c in range(most))]
    for name, per in rates.items():
        cells = []
        for c in range(most):
            got = [r[c] for r in per if len(r) > c and r[c] is not None]
            cells.append(f"{sum(got) / len(got):8.3f}" if got else f"{'-':>8}")
        lines.append(f"{name:<{w}}" + "".join(cells))
    return lines
