"""Learning benchmark: does training make the multi-agent system better, arm by arm, over seeds?

Run::

    python -m benchmarks.fidelity --seeds 1,2,3,4,5 [--config configs/cpu/standin_onpolicy.yaml]
        [--json results/bench_fidelity.json] [--png results/bench_fidelity.png]
        [--eval_n 400] [--sampled_n 400] [--samples 4] [--jobs 2] [--arms ADMM-ring,Centralized]
        [--select last|best] [key=value ...]

What one run does, for every seed of ``--seeds``:

1. **One first collection per seed.** A dry run collects the on-policy fit set under the
   config (with that ``seed``) and writes it to the seed's ``fitset_cache``; every arm of the
   seed reads the same file, so the arms start from the same examples. With
   ``recollect_every N`` each arm then collects again every N rounds on fresh training
   queries under its own current adapter (Algorithm A1, step 3); the benchmark reports every
   collection's pass rate per arm and, for the arms that deploy one consensus adapter, the
   learning curve: greedy accuracy after each collection's rounds (z of that round's
   checkpoint), with its interval.
2. **The arms** (:data:`ARMS`), each a real :class:`admm_dist.training.trainer.Trainer` run with the
   single-process backend (all nodes in one process on one backbone: the numbers of one
   gloo rank per node, which ``tests/training/test_trainer.py`` checks for every arm):
   ADMM-ring (the config as it is), ADMM-gossip (``consensus=gossip``, deployed per seat),
   ADMM-decentralized (``consensus=decentralized``, deployed per seat),
   Centralized (``pooled`` on one node), ADMM-Local (``local_only``, deployed per seat) and
   ADMM-NoDual (``no_dual``); ADMM-ring-int8 and ADMM-decentralized-int8 (``compress=int8``)
   and ADMM-ring-int4 (``compress=int4``) when ``--arms`` names them; GRPO-ring, GRPO-Centralized,
   GRPO-Local and GRPO-NoDual (the same four, ``fit_mode=grpo`` with a collection every round
   on 24 fresh queries, eta 1e-3: :data:`benchmarks.fidelity_run.GRPO`) likewise. ``key=value``
   arguments override the config for every arm.
3. **Evaluation** of each arm on the same held-out rows (the front rows of the task's
   evaluation pool under ``--eval_seed``, checked against the arm's training report for
   leakage): greedy on the front ``--eval_n``, sampled on the front ``--sampled_n``
   (``--samples`` chains a row at the config's temperature and top_p, with the same sampling
   seed for every arm). The learning curve is read greedy on the ``--sampled_n`` front rows
   too, so each of its points costs an evaluation of those rows, not of all ``--eval_n``. The
   base (no adapter) is evaluated once: it does not depend on the training seed. A consensus
   arm deploys its ``-last`` file, or with ``--select best`` (and ``dev_frac``) its ``-best``:
   z at the round with the lowest held-out NLL, which the JSON records per arm and seed; the
   arms that deploy per seat deploy their last states either way.

Statistics. For an arm, d[s, r] is its accuracy on row r after training with seed s minus
the base's accuracy on row r (rows scored 0/1 greedy, or the share of right chains when
sampled). The gain is the mean of d; its 95% interval is a crossed bootstrap that resamples
seeds and rows independently (``--boot`` resamples), so it covers both the variation of
training across seeds and the finite set of evaluation rows. A t-interval over the per-seed
gains (seeds only) is in the JSON too. Arm-against-arm differences (each arm minus ADMM-ring)
use the same bootstrap on their paired per-row differences.

Work is split over ``--jobs`` worker processes, one job each at a time, one torch thread per
worker: the base's evaluation, each seed's first collection, and one job per seed and arm
(started once its seed's collection is there), so the workers stay busy to the end whatever
the number of seeds. Each job writes ``<workdir>/<job>.json``, and the parent assembles the
table, the JSON (``--json``) and the figure (``--png``: accuracy by arm with its interval
and per-seed points, then each arm's per-round local objectives and primal residuals,
averaged over seeds; with ``recollect_every``, a second figure ``PATH-curve.png``: the
learning curve). ``--reuse`` keeps a job's file when its settings are unchanged.

This module owns the command line (:func:`parse_args`) and the whole run: the worker processes,
one job each (:func:`main` with ``--job`` in a worker), and the assembly of their results. The
arms and one job are in :mod:`benchmarks.fidelity_run`, the statistics, the table and the
figure in :mod:`benchmarks.fidelity_stats`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from admm_dist.bench.common import write_json
from benchmarks.fidelity_run import (
    ARM_NAMES,
    BASE,
    COLLECT,
    DEFAULT_ARMS,
    REFERENCE,
    SELECTIONS,
    BenchError,
    arm_job,
    assemble_seed,
    base_config,
    job_key,
    parse_job,
    parse_seeds,
    refused_job,
    run_job,
    seed_jobs,
)
from benchmarks.fidelity_stats import format_table, summarize
from admm_dist.core.errors import UserError

PROG = "python -m benchmarks.fidelity"
DEFAULT_CONFIG = "configs/cpu/standin_onpolicy.yaml"
SAMPLED_N = 400   # sampled chains cost --samples greedy ones a row: more greedy rows cost less


# --------------------------------------------------------------------------- settings
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--seeds", default="1,2,3,4,5", help="training seeds, comma-separated")
    a("--config", default=DEFAULT_CONFIG, help="the training config every arm starts from")
    a("--arms", default=",".join(DEFAULT_ARMS),
      help=f"arms to run, from {', '.join(ARM_NAMES)} (default: {', '.join(DEFAULT_ARMS)})")
    a("--eval_n", type=int, default=400, help="held-out rows scored greedy")
    a("--sampled_n", type=int, default=None,
      help=f"the front held-out rows scored sampled and along the learning curve "
           f"(default {SAMPLED_N}, or --eval_n when that is fewer)")
    a("--eval_seed", type=int, default=42, help="pool order and sampling seed of the evaluation")
    a("--samples", type=int, default=4, help="sampled chains per row (0: greedy only)")
    a("--select", choices=SELECTIONS, default="last",
      help="which file the consensus arms deploy: last (z after the last round) or best (the round "
           "with the lowest held-out NLL: needs dev_frac, e.g. dev_frac=0.1)")
    a("--versus", default=REFERENCE, metavar="ARM",
      help=f"the arm the 'vs' column subtracts, paired per row (default {REFERENCE}); with --reuse, "
           "any pair of arms already run, e.g. --versus Centralized")
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
    args.seed_list = parse_seeds(args.seeds)
    args.arm_list = [s.strip() for s in str(args.arms).split(",") if s.strip()]
    bad = [a for a in args.arm_list if a not in ARM_NAMES]
    if bad or not args.arm_list:
        raise BenchError(f"--arms: unknown arm(s) {bad}: choose from {', '.join(ARM_NAMES)}")
    if args.versus not in args.arm_list:
        raise BenchError(f"--versus {args.versus}: the arm compared against must run too: add it to --arms")
    if args.sampled_n is None:
        args.sampled_n = min(SAMPLED_N, args.eval_n)
    for name in ("eval_n", "sampled_n", "boot", "jobs", "threads"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name} {getattr(args, name)}: it must be >= 1")
    if args.sampled_n > args.eval_n:
        raise BenchError(f"--sampled_n {args.sampled_n} > --eval_n {args.eval_n}: the sampled rows are the "
                         f"front of the greedy ones; lower --sampled_n")
    if args.samples < 0:
        raise BenchError(f"--samples {args.samples}: use 0 (greedy only) or more chains a row")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise BenchError(f"override {bad[0]!r}: write key=value (e.g. eta=0.001)")
    if not os.path.isfile(args.config):
        raise BenchError(f"--config {args.config} does not exist: pass a file from configs/")
    args.train_config = base_config(args, args.seed_list[0])   # a bad key fails here, before any work
    from admm_dist.model.pretrained import unbuilt

    missing = unbuilt(args.train_config.model_name)
    if missing:
        raise BenchError(missing)
    if args.select == "best" and not args.train_config.dev_frac > 0:
        raise BenchError("--select best deploys each consensus arm's -best file, which needs a held-out set: "
                         "add dev_frac=0.1")
    return args


def curve_png(png: str) -> str:
    """Where ``--png`` PATH's learning curve goes: PATH with ``-curve`` before its extension."""
    stem, ext = os.path.splitext(png)
    return f"{stem}-curve{ext or '.png'}"


# --------------------------------------------------------------------------- the whole run
def _run_worker(args, job: str, argv: Sequence[str]) -> dict:
    refused = refused_job(args, job)
    if refused is not None:
        return refused
    path = os.path.join(args.workdir, f"{job}.json")
    if args.reuse and os.path.isfile(path):
        with open(path) as fh:
            old = json.load(fh)
        if old.get("key") == job_key(args, job):
            return old
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONHASHSEED="0")
    cmd = [sys.executable, "-m", "benchmarks.fidelity", *argv, "--job", job]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise BenchError(f"job {job} failed (exit {p.returncode}): {tail[0]}")
    with open(path) as fh:
        return json.load(fh)


def job_order(args) -> List[str]:
    """Every job, in the order workers take them: the base, every seed's first collection (each
    seed's arms need it), then the arms seed by seed."""
    per_seed = [seed_jobs(s, args.arm_list) for s in args.seed_list]
    return [BASE] + [jobs[0] for jobs in per_seed] + [j for jobs in per_seed for j in jobs[1:]]


def run_jobs(args, argv: Sequence[str], t0: float) -> Dict[str, dict]:
    """Run every job on ``--jobs`` worker processes, an arm's job only once its seed's collection
    is done; the first failure stops the run (jobs already running finish, no new one starts)."""
    todo = job_order(args)
    needs = {j: None if j == BASE or parse_job(j)[1] == COLLECT else arm_job(parse_job(j)[0], COLLECT)
             for j in todo}
    results: Dict[str, dict] = {}
    cond = threading.Condition()
    failed: List[BaseException] = []

    def take() -> Optional[str]:
        with cond:
            while True:
                if failed:
                    return None
                ready = [j for j in todo if needs[j] is None or needs[j] in results]
                if ready:
                    todo.remove(ready[0])
                    return ready[0]
                if not todo:
                    return None
                cond.wait(timeout=5.0)

    def worker() -> None:
        while (job := take()) is not None:
            try:
                res = _run_worker(args, job, argv)
            except BaseException as e:   # noqa: BLE001 (handed to the main thread)
                with cond:
                    failed.append(e)
                    cond.notify_all()
                return
            with cond:
                results[job] = res
                cond.notify_all()
            print(f"[{time.time() - t0:6.0f}s] {job} done in {res['seconds']:.0f}s", flush=True)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    return results


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
        results = run_jobs(args, argv, t0)
        seeds = [assemble_seed(args, s, results[arm_job(s, COLLECT)],
                               {name: results[arm_job(s, name)] for name in args.arm_list})
                 for s in args.seed_list]
        summary = summarize(args, results[BASE], seeds)
        summary.update(config=args.config, overrides=args.overrides, eval_n=args.eval_n,
                       sampled_n=args.sampled_n, eval_seed=args.eval_seed, samples=args.samples,
                       boot=args.boot, select=args.select,
                       jobs=args.jobs, threads=args.threads, seconds=round(time.time() - t0, 1),
                       train_config=args.train_config.as_dict())
        print(format_table(summary, args))
        print(f"\n{len(args.seed_list)} seed(s), {len(args.arm_list)} arm(s) in {summary['seconds']:.0f}s")
        if args.json:
            write_json(args.json, summary, f"wrote {args.json}")
        if args.png:
            from admm_dist.plots import figures   # matplotlib loads only when a figure is asked for

            title = f"learning benchmark: {len(args.seed_list)} seed(s), {args.eval_n} eval rows"
            source = args.json or "python -m benchmarks.fidelity"
            figures.save(figures.bench_overview(summary, args.arm_list, title), args.png, title, source)
            print(f"wrote {args.png}")
            if summary.get("curves"):
                path = curve_png(args.png)
                title = f"learning curve: {len(args.seed_list)} seed(s), {args.sampled_n} eval rows"
                figures.save(figures.learning_curve(summary, title), path, title, source)
                print(f"wrote {path}")
        return 0
    except (UserError, subprocess.TimeoutExpired) as e:   # BenchError, or a training setting in a job
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
