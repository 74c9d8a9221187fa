"""Learning benchmark: does training make the multi-agent system better, arm by arm, over seeds?

Run::

    python -m admm_dist.bench.fidelity --seeds 1,2,3,4,5 [--config configs/cpu/standin_onpolicy.yaml]
        [--json results/bench_fidelity.json] [--png results/bench_fidelity.png]
        [--eval_n 400] [--samples 4] [--jobs 2] [--arms ADMM-ring,Centralized] [key=value ...]

What one run does, for every seed of ``--seeds``:

1. **One collection.** The first training arm collects the on-policy fit set under the
   config (with that ``seed``) and writes it to the seed's ``fitset_cache``; every other arm
   of the seed reads the same file, so the arms differ only in how they train.
2. **The arms** (:data:`ARMS`), each a real :class:`admm_dist.training.trainer.Trainer` run with the
   single-process backend (all nodes in one process on one backbone: the numbers of one
   gloo rank per node, which ``tests/test_train.py`` checks for every arm):
   ADMM-ring (the config as it is), ADMM-gossip (``consensus=gossip``, deployed per seat),
   Centralized (``pooled`` on one node), ADMM-Local (``local_only``, deployed per seat) and
   ADMM-NoDual (``no_dual``). ``key=value`` arguments override the config for every arm.
3. **Evaluation** of each arm on the same held-out rows (the front ``--eval_n`` rows of the
   task's evaluation pool under ``--eval_seed``, checked against the arm's training report
   for leakage), greedy and sampled (``--samples`` chains a row at the config's temperature
   and top_p, with the same sampling seed for every arm). The base (no adapter) is
   evaluated once: it does not depend on the training seed.

Statistics. For an arm, d[s, r] is its accuracy on row r after training with seed s minus
the base's accuracy on row r (rows scored 0/1 greedy, or the share of right chains when
sampled). The gain is the mean of d; its 95% interval is a crossed bootstrap that resamples
seeds and rows independently (``--boot`` resamples), so it covers both the variation of
training across seeds and the finite set of evaluation rows. A t-interval over the per-seed
gains (seeds only) is in the JSON too. Arm-against-arm differences (each arm minus ADMM-ring)
use the same bootstrap on their paired per-row differences.

Work is split over ``--jobs`` worker processes, one seed (or the base) each, one torch
thread per worker; each writes ``<workdir>/<job>.json``, and the parent assembles the
table, the JSON (``--json``) and the figure (``--png``: accuracy by arm with its interval
and per-seed points, then each arm's per-round local objectives and primal residuals,
averaged over seeds). ``--reuse`` keeps a job's file when its settings are unchanged.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

PROG = "python -m admm_dist.bench.fidelity"
DEFAULT_CONFIG = "configs/cpu/standin_onpolicy.yaml"


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple          # key=value strings on top of the config
    deploy: str               # consensus: one z on every seat; local: each seat its node's state
    role: str                 # what the seed's Table 2 makes of it


ARMS = (
    Arm("ADMM-ring", (), "consensus", "consensus ADMM, exact mean over a ring (the default)"),
    Arm("ADMM-gossip", ("consensus=gossip",), "local", "inexact consensus by neighbour mixing"),
    Arm("Centralized", ("pooled=true", "consensus=coordinator"), "consensus",
        "every example on one node: the pooled optimum ADMM approaches"),
    Arm("ADMM-Local", ("local_only=true",), "local", "ablation: no coupling, each seat alone"),
    Arm("ADMM-NoDual", ("no_dual=true",), "consensus", "ablation: penalty method, u stays 0"),
)
ARM_NAMES = tuple(a.name for a in ARMS)
BASE = "base"
REFERENCE = "ADMM-ring"


class BenchError(ValueError):
    """Bad benchmark input; the message names the fix."""


# --------------------------------------------------------------------------- settings
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--seeds", default="1,2,3,4,5", help="training seeds, comma-separated")
    a("--config", default=DEFAULT_CONFIG, help="the training config every arm starts from")
    a("--arms", default=",".join(ARM_NAMES), help=f"subset of {', '.join(ARM_NAMES)}")
    a("--eval_n", type=int, default=400, help="held-out rows")
    a("--eval_seed", type=int, default=42, help="pool order and sampling seed of the evaluation")
    a("--samples", type=int, default=4, help="sampled chains per row (0: greedy only)")
    a("--boot", type=int, default=2000, help="bootstrap resamples for the intervals")
    a("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    a("--threads", type=int, default=1, help="torch threads per worker")
    a("--workdir", default="runs/bench_fidelity", help="fit sets, adapters, reports, per-job results")
    a("--json", default=None, metavar="PATH")
    a("--png", default=None, metavar="PATH")
    a("--reuse", action="store_true", help="keep a job's result when its settings are unchanged")
    a("--timeout_s", type=float, default=3600.0, help="bound on one worker job")
    a("--job", default=None, help=argparse.SUPPRESS)      # internal: run one job in this process
    a("overrides", nargs="*", metavar="key=value", help="config overrides for every arm")
    args = p.parse_args(argv)
    try:
        args.seed_list = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    except ValueError:
        raise BenchError(f"--seeds {args.seeds!r}: write integers separated by commas, e.g. 1,2,3") from None
    if not args.seed_list or len(set(args.seed_list)) != len(args.seed_list):
        raise BenchError(f"--seeds {args.seeds!r}: give at least one seed, each once")
    args.arm_list = [s.strip() for s in str(args.arms).split(",") if s.strip()]
    bad = [a for a in args.arm_list if a not in ARM_NAMES]
    if bad or not args.arm_list:
        raise BenchError(f"--arms: unknown arm(s) {bad}: choose from {', '.join(ARM_NAMES)}")
    for name in ("eval_n", "boot", "jobs", "threads"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name} {getattr(args, name)}: it must be >= 1")
    if args.samples < 0:
        raise BenchError(f"--samples {args.samples}: use 0 (greedy only) or more chains a row")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise BenchError(f"override {bad[0]!r}: write key=value (e.g. eta=0.001)")
    if not os.path.isfile(args.config):
        raise BenchError(f"--config {args.config} does not exist: pass a file from configs/")
    args.train_config = base_config(args, args.seed_list[0])   # a bad key fails here, before any work
    return args


def base_config(args, seed: int, arm: Optional[Arm] = None, *, quiet: bool = True):
    from admm_dist.core import config_file as config_mod
    from admm_dist.training.config import TrainConfig

    seed_dir = os.path.join(args.workdir, f"seed{seed}")
    name = (arm.name if arm else "probe").lower()
    argv = ["--config", args.config, *(arm.overrides if arm else ()), *args.overrides,
            f"seed={seed}", f"fitset_cache={os.path.join(seed_dir, 'fitset.jsonl')}",
            f"out={os.path.join(seed_dir, name)}", f"report_dir={seed_dir}", "device=cpu",
            "overwrite=true",   # a job rerun (not --reuse) replaces that arm's earlier run
            f"quiet={str(quiet).lower()}"]
    try:
        return config_mod.load(TrainConfig, argv)
    except (config_mod.ConfigError, ValueError) as e:
        raise BenchError(f"config {args.config} with {' '.join(args.overrides) or 'no overrides'}: {e}") from None


def job_key(args, job: str) -> str:
    """What a job's result depends on (``--reuse`` compares it)."""
    cfg = args.train_config
    d = {"job": job, "config": {k: v for k, v in cfg.as_dict().items()
                                if k not in ("seed", "fitset_cache", "out", "report_dir", "quiet")},
         "arms": args.arm_list, "eval_n": args.eval_n, "eval_seed": args.eval_seed,
         "samples": args.samples, "threads": args.threads, "version": 1}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- one job
def eval_argv(args, cfg, *, sampled: bool) -> List[str]:
    argv = ["--task", cfg.task, "--model_name", cfg.model_name, "--seed", str(args.eval_seed),
            "--n", str(args.eval_n), "--n_agents", str(cfg.n_agents), "--prompt", cfg.prompt,
            "--max_new_tokens", str(cfg.max_new_tokens), "--batch_size", str(max(cfg.gen_batch_size, 64)),
            "--adapt_roles", cfg.adapt_roles, "--device", "cpu"]
    if cfg.task_path:
        argv += ["--task_path", cfg.task_path]
    if cfg.think:
        argv += ["--think"]
    if cfg.text_mas_context_length:
        argv += ["--text_mas_context_length", str(cfg.text_mas_context_length)]
    if cfg.agent_models:
        argv += ["--agent_models", cfg.agent_models]
    if sampled:
        argv += ["--temperature", str(cfg.temperature), "--top_p", str(cfg.top_p),
                 "--samples", str(args.samples)]
    return argv


def score_rows(args, cfg, deploy_argv: List[str]) -> Dict[str, List[float]]:
    """Per-row accuracy, greedy and (with --samples) sampled: the share of right chains."""
    from admm_dist.mas import evaluation as evaluate

    out = {}
    for mode in ("greedy", "sampled") if args.samples else ("greedy",):
        ev = evaluate.build_parser().parse_args(eval_argv(args, cfg, sampled=mode == "sampled") + deploy_argv)
        _, chains, outcome = evaluate.run(ev)
        per = 1 if mode == "greedy" else args.samples
        right = [float(bool(o["correct"])) for o in outcome]
        out[mode] = [sum(right[i:i + per]) / per for i in range(0, len(right), per)]
        out[mode + "_anchors"] = [str(it["anchor"]) for it, _ in chains[::per]]
    return out


def train_arm(cfg) -> Dict[str, object]:
    """One Trainer run in this process; a refusal is a result, not a crash of the benchmark."""
    from admm_dist.engine.dist import distributed
    from admm_dist.training.trainer import TrainError, Trainer

    t0 = time.time()
    try:
        with distributed(cfg.device, timeout_s=cfg.timeout_s) as ctx:
            report = Trainer(cfg, ctx, log=lambda m: None).train()
    except TrainError as e:
        return {"refused": str(e), "train_sec": round(time.time() - t0, 2)}
    rounds = report.get("rounds") or []
    return {"refused": None, "train_sec": round(time.time() - t0, 2),
            "f": [r["f"] for r in rounds], "primal_normalized": [r["primal_normalized"] for r in rounds],
            "primal": [r["primal"] for r in rounds], "dual": [r["dual"] for r in rounds],
            "delta_w_rel": report.get("delta_w_rel"), "node_sizes": report.get("node_sizes"),
            "collection": {k: report.get("collection", {}).get(k) for k in
                           ("kept_queries", "examples", "mean_pass_rate", "mixed_group_rate")}}


def deployed_vectors(cfg, arm: Arm) -> Dict[int, "object"]:
    """{seat: the flat vector that arm deploys on it} (for distances between arms)."""
    from safetensors.torch import load_file

    if arm.deploy == "consensus":
        vec = load_file(cfg.out + "-last.safetensors")["b"]
        return {s: vec for s in cfg.adapted_seats()}
    with open(os.path.join(cfg.out, "seat_map.json")) as fh:
        node_of = json.load(fh)["node_of_seat"]
    key = "x" if cfg.local_only else "z"
    return {int(s): load_file(os.path.join(cfg.out, f"node-{n}.safetensors"))[key] for s, n in node_of.items()}


def run_job(args, job: str) -> Dict[str, object]:
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.time()
    if job == BASE:
        cfg = args.train_config
        return {"job": job, "key": job_key(args, job), "rows": score_rows(args, cfg, []),
                "seconds": round(time.time() - t0, 2)}
    seed = int(job.removeprefix("seed"))
    arms: Dict[str, dict] = {}
    vectors = {}
    for arm in (a for a in ARMS if a.name in args.arm_list):
        try:
            cfg = base_config(args, seed, arm)
        except BenchError as e:   # e.g. rho_adapt on an ablation: that arm is refused, not the run
            arms[arm.name] = {"refused": str(e)}
            continue
        res = train_arm(cfg)
        if res["refused"] is None:
            report = os.path.join(cfg.report_dir, f"{os.path.basename(cfg.out)}-train.json")
            deploy = (["--adapter", cfg.out + "-last.safetensors"] if arm.deploy == "consensus"
                      else ["--deploy", "local", "--state", cfg.out])
            res["rows"] = score_rows(args, cfg, deploy + ["--train_report", report])
            vectors[arm.name] = deployed_vectors(cfg, arm)
        arms[arm.name] = res
    ref = vectors.get("Centralized")
    if ref:
        for name, vec in vectors.items():
            d = [float((vec[s] - ref[s]).norm() / ref[s].norm().clamp_min(1e-30)) for s in sorted(ref)]
            arms[name]["distance_to_centralized"] = d
    return {"job": job, "key": job_key(args, job), "seed": seed, "arms": arms,
            "seconds": round(time.time() - t0, 2)}


# --------------------------------------------------------------------------- statistics
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
    out: Dict[str, object] = {"modes": {}, "arms": {}, "seeds": [s["seed"] for s in seeds]}
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
        if REFERENCE in rows_of:
            ref = rows_of[REFERENCE]
            for name, rows in rows_of.items():
                if name == REFERENCE:
                    continue
                d = [[y - x for y, x in zip(r, q)] for r, q in zip(rows, ref)]
                diff = [sum(r) / len(r) for r in d]
                table[name]["minus_ref"] = sum(diff) / len(diff)
                table[name]["minus_ref_ci95"] = list(crossed_bootstrap(d, args.boot, seed=1))
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
        }
    out["collection"] = [next((a.get("collection") for a in s["arms"].values() if a.get("collection")), None)
                         for s in seeds]
    return out


def format_table(summary: Dict[str, object], args) -> str:
    lines = []
    seeds = summary["seeds"]
    for mode, table in summary["modes"].items():
        how = "greedy" if mode == "greedy" else f"sampled, {args.samples} chains a row"
        lines.append(f"\n{mode} accuracy on {args.eval_n} held-out rows ({how}); gain = arm - base, "
                     f"95% CI over seeds and rows")
        head = f"{'arm':<13}" + "".join(f"{'s' + str(s):>7}" for s in seeds) + \
            f"{'mean':>8}{'gain':>8}{'95% CI':>18}{'wins':>6}{'vs ring':>9}{'95% CI':>18}"
        lines.append(head)
        for name in [BASE] + list(args.arm_list):
            r = table.get(name)
            if r is None:
                continue
            if "refused" in r:
                lines.append(f"{name:<13} refused on seed(s) {', '.join(r['refused'])}: "
                             f"{next(iter(r['refused'].values()))[:80]}")
                continue
            row = f"{name:<13}" + "".join(f"{a:7.3f}" for a in r["accuracy"]) + f"{r['mean']:8.3f}"
            if "gain" in r:
                lo, hi = r["gain_ci95"]
                row += f"{r['gain']:+8.3f}{f'[{lo:+.3f}, {hi:+.3f}]':>18}{r['wins']:>4}/{len(seeds)}"
                if "minus_ref" in r:
                    lo, hi = r["minus_ref_ci95"]
                    row += f"{r['minus_ref']:+9.3f}{f'[{lo:+.3f}, {hi:+.3f}]':>18}"
            lines.append(row)
    return "\n".join(lines)


def draw(summary: Dict[str, object], path: str, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from admm_dist.core.io import atomic_write_bytes

    modes = list(summary["modes"])
    fig, axes = plt.subplots(1, len(modes) + 2, figsize=(5 * (len(modes) + 2), 4.2))
    for ax, mode in zip(axes, modes):
        table = summary["modes"][mode]
        names = [n for n in [BASE] + list(args.arm_list) if n in table and "refused" not in table[n]]
        base = table[BASE]["mean"]
        for i, n in enumerate(names):
            r = table[n]
            ax.bar(i, r["mean"], color="lightgray" if n == BASE else "C0", alpha=0.8)
            ax.scatter([i] * len(r["accuracy"]), r["accuracy"], color="k", s=10, zorder=3)
            if "gain_ci95" in r:
                lo, hi = r["gain_ci95"]
                ax.errorbar(i, r["mean"], yerr=[[r["gain"] - lo], [hi - r["gain"]]], color="C3", capsize=4)
        ax.axhline(base, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{mode} accuracy (bars: mean over seeds; red: 95% CI of the gain)", fontsize=8)
    for ax, key, title in ((axes[-2], "f", "local objective f_i (mean over nodes)"),
                           (axes[-1], "primal_normalized", "max normalized primal residual")):
        for j, name in enumerate(args.arm_list):
            runs = [r for r in summary["arms"][name][key] if r]
            if not runs:
                continue
            agg = [(sum(v) / len(v)) if key == "f" else max(v) for v in zip(*[[
                (sum(row) / len(row) if key == "f" else max(row)) for row in run] for run in runs])]
            ax.plot(range(1, len(agg) + 1), agg, marker="o", ms=3, label=name, color=f"C{j}")
        ax.set_xlabel("round")
        ax.set_title(title + ", mean over seeds" if key == "f" else title + ", worst seed", fontsize=8)
        if key != "f":
            ax.set_yscale("symlog", linthresh=1e-3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


# --------------------------------------------------------------------------- the whole run
def _run_worker(args, job: str, argv: Sequence[str]) -> dict:
    path = os.path.join(args.workdir, f"{job}.json")
    if args.reuse and os.path.isfile(path):
        with open(path) as fh:
            old = json.load(fh)
        if old.get("key") == job_key(args, job):
            return old
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONHASHSEED="0")
    cmd = [sys.executable, "-m", "admm_dist.bench.fidelity", *argv, "--job", job]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise BenchError(f"job {job} failed (exit {p.returncode}): {tail[0]}")
    with open(path) as fh:
        return json.load(fh)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
        if args.job:
            from admm_dist.core.io import atomic_write_json
            from admm_dist.core.libraries import quiet_libraries

            quiet_libraries()
            res = run_job(args, args.job)
            atomic_write_json(os.path.join(args.workdir, f"{args.job}.json"), res)
            return 0
        t0 = time.time()
        os.makedirs(args.workdir, exist_ok=True)
        jobs = [BASE] + [f"seed{s}" for s in args.seed_list]
        results: Dict[str, dict] = {}
        with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futs = {pool.submit(_run_worker, args, j, argv): j for j in jobs}
            for fut in cf.as_completed(futs):
                j = futs[fut]
                results[j] = fut.result()
                print(f"[{time.time() - t0:6.0f}s] {j} done in {results[j]['seconds']:.0f}s", flush=True)
        summary = summarize(args, results[BASE], [results[f"seed{s}"] for s in args.seed_list])
        summary.update(config=args.config, overrides=args.overrides, eval_n=args.eval_n,
                       eval_seed=args.eval_seed, samples=args.samples, boot=args.boot,
                       jobs=args.jobs, threads=args.threads, seconds=round(time.time() - t0, 1),
                       train_config=args.train_config.as_dict())
        print(format_table(summary, args))
        print(f"\n{len(args.seed_list)} seed(s), {len(args.arm_list)} arm(s) in {summary['seconds']:.0f}s")
        if args.json:
            from admm_dist.core.io import atomic_write_json

            atomic_write_json(args.json, summary)
            print(f"wrote {args.json}")
        if args.png:
            draw(summary, args.png, args)
            print(f"wrote {args.png}")
        return 0
    except (BenchError, subprocess.TimeoutExpired) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
