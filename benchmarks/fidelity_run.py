"""The per-seed run of the learning benchmark (``python -m benchmarks.fidelity``).

It owns the arms (:data:`ARMS`: name, config overrides, how each deploys), the benchmark's
error (:class:`BenchError`), each arm's config (:func:`base_config`) and what a job's result
depends on (:func:`job_key`, compared by ``--reuse``), an arm its settings refuse
(:func:`refused_job`, decided without a worker), and one job (:func:`run_job`): the
base's evaluation, or for one seed every arm trained (:func:`train_arm`), evaluated greedy and
sampled on the held-out rows (:func:`score_rows`) and its deployed vectors' distances to
Centralized (:func:`deployed_vectors`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Dict, List, Optional

from admm_dist.core.errors import UserError


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple          # key=value strings on top of the config
    deploy: str               # consensus: one z on every seat; local: each seat its node's state
    role: str                 # what the reference implementation's Table 2 makes of it
    default: bool = True      # run when --arms is not given


ARMS = (
    Arm("ADMM-ring", (), "consensus", "consensus ADMM, exact mean over a ring (the default)"),
    Arm("ADMM-gossip", ("consensus=gossip",), "local", "inexact consensus by neighbour mixing"),
    # decentralized ADMM ended within 0.7 points of ADMM-ring, and the compressed arms gave their
    # fp32 arms' answers on every row (docs/benchmarks.md): they measure consensus for slow links,
    # not learning, so they run when asked for (--arms), keeping the default benchmark in an hour
    Arm("ADMM-decentralized", ("consensus=decentralized",), "local",
        "node-based decentralized ADMM: one neighbour exchange per round, exact at convergence",
        default=False),
    Arm("ADMM-ring-int8", ("compress=int8",), "consensus", "ADMM-ring with int8 payloads (0.27x the bytes)",
        default=False),
    Arm("ADMM-decentralized-int8", ("consensus=decentralized", "compress=int8"), "local",
        "ADMM-decentralized with int8 payloads", default=False),
    Arm("ADMM-ring-int4", ("compress=int4",), "consensus", "ADMM-ring with int4 payloads (0.14x the bytes)",
        default=False),
    Arm("Centralized", ("pooled=true", "consensus=coordinator"), "consensus",
        "every example on one node: the pooled optimum ADMM approaches"),
    # rho_adapt balances ADMM's primal and dual residuals by rescaling the dual: the ablations keep
    # the config's rho (a rho_adapt given on the command line still refuses them)
    Arm("ADMM-Local", ("local_only=true", "rho_adapt=false"), "local",
        "ablation: no coupling, each seat alone"),
    Arm("ADMM-NoDual", ("no_dual=true", "rho_adapt=false"), "consensus",
        "ablation: penalty method at the config's rho, u stays 0"),
)
# GRPO (fit_mode grpo): the same seats and ablations, trained by group-relative policy optimisation on
# messages the chain samples every round (recollect_every 1, on 24 fresh queries each time), from the
# same first collection; run when asked for (--arms GRPO-ring,...). eta chosen on seeds 1-5 only:
# 3e-4 (the DPO default's) trailed ADMM-ring by 4.2 points, 1e-3 matched it (docs/benchmarks.md)
GRPO = ("fit_mode=grpo", "recollect_every=1", "recollect_anchors=24", "eta=0.001")
ARMS += tuple(Arm(f"GRPO-{a.name.replace('ADMM-', '')}", GRPO + a.overrides, a.deploy, f"{a.role}, by GRPO",
                  default=False)
              for a in ARMS if a.name in ("ADMM-ring", "Centralized", "ADMM-Local", "ADMM-NoDual"))
ARM_NAMES = tuple(a.name for a in ARMS)
DEFAULT_ARMS = tuple(a.name for a in ARMS if a.default)
ARM_BY_NAME = {a.name: a for a in ARMS}
BASE = "base"
REFERENCE = "ADMM-ring"
SELECTIONS = ("last", "best")   # which file a consensus arm deploys: -last (z after the last round) or -best
COLLECTION_KEYS = ("kept_queries", "examples", "mean_pass_rate", "mixed_group_rate")


class BenchError(UserError):
    """Bad benchmark input; the message names the fix."""


# --------------------------------------------------------------------------- settings
def parse_seeds(text: str) -> List[int]:
    """``--seeds 1,2,3`` as a list, each seed once."""
    try:
        seeds = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise BenchError(f"--seeds {text!r}: write integers separated by commas, e.g. 1,2,3") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise BenchError(f"--seeds {text!r}: give at least one seed, each once")
    return seeds


def first_fitset(workdir: str, seed: int) -> str:
    """The seed's first collection, which every arm of the seed reads."""
    return os.path.join(workdir, f"seed{seed}", "fitset.jsonl")


def arm_out(workdir: str, seed: int, name: str) -> str:
    """An arm's ``out`` (its job folder; its ``-last``/``-roundK`` files beside it)."""
    return os.path.join(workdir, f"seed{seed}", name.lower())


def base_config(args, seed: int, arm: Optional[Arm] = None, *, quiet: bool = True):
    from admm_dist.core import config_file as config_mod
    from admm_dist.training.config import TrainConfig

    seed_dir = os.path.join(args.workdir, f"seed{seed}")
    argv = ["--config", args.config, *(arm.overrides if arm else ()), *args.overrides,
            f"seed={seed}", f"fitset_cache={first_fitset(args.workdir, seed)}",
            f"out={arm_out(args.workdir, seed, arm.name if arm else 'probe')}", f"report_dir={seed_dir}",
            "device=cpu",
            "overwrite=true",   # a job rerun (not --reuse) replaces that arm's earlier run
            f"quiet={str(quiet).lower()}"]
    try:
        cfg = config_mod.load(TrainConfig, argv)
        if cfg.recollect_every and cfg.keep_checkpoints < cfg.k_outer:
            # the learning curve reads z at the end of every collection's rounds
            cfg = dataclasses.replace(cfg, keep_checkpoints=cfg.k_outer)
        return cfg
    except (config_mod.ConfigError, ValueError) as e:
        raise BenchError(f"config {args.config} with "
                         f"{' '.join(args.overrides) or 'no overrides'}: {e}") from None


# the learning curve is read at most this often, the last round included (each read is an evaluation):
# with a collection every round, every few rounds
CURVE_POINTS = 4


def curve_rounds(cfg) -> List[int]:
    """Rounds that end a collection's training, evenly spaced, at most ``CURVE_POINTS`` of them, the
    last round included: where the learning curve is read (the last only when the run collects once)."""
    every = cfg.recollect_every
    if not every:
        return [cfg.k_outer]
    step = every * -(-(-(-cfg.k_outer // every)) // CURVE_POINTS)   # a whole number of collections
    return list(range(step, cfg.k_outer, step)) + [cfg.k_outer]


def score_curve(args, cfg, final_rows: List[float], report: str) -> Dict[str, object]:
    """Greedy accuracy per row of the front ``--sampled_n`` rows after each collection's rounds (a
    consensus arm: z of that round's checkpoint on every seat, saved with the ``-last`` file's
    adapter identity; the last point is the front of ``final_rows`` when the arm deploys
    ``-last``, else the last round's checkpoint too)."""
    from safetensors.torch import load_file

    from admm_dist.model.vectors import load_vector, save_vector
    from admm_dist.training.checkpoint import ckpt_root, round_dir

    rounds = curve_rounds(cfg)
    _, meta = load_vector(cfg.out + "-last.safetensors")
    rows = []
    final_is_last = args.select == "last"       # the deployed -last file was scored already
    for k in rounds[:-1] if final_is_last else rounds:
        z = load_file(os.path.join(round_dir(ckpt_root(cfg.out), k), "node-0.safetensors"))["z"]
        path = f"{cfg.out}-round{k}.safetensors"
        save_vector(path, z, dict(meta, round=k))
        rows.append(score_rows(args, cfg, ["--adapter", path, "--train_report", report],
                               greedy_n=args.sampled_n, sampled_n=0)["greedy"])
    if final_is_last:
        rows.append(final_rows[:args.sampled_n])
    return {"rounds": rounds, "greedy": rows}


COLLECT = "collect"     # the job that makes a seed's shared first collection


def seed_jobs(seed: int, arm_names) -> List[str]:
    """A seed's jobs: its first collection, then one per arm (each needs the collection)."""
    return [arm_job(seed, COLLECT)] + [arm_job(seed, name) for name in arm_names]


def arm_job(seed: int, name: str) -> str:
    return f"seed{seed}-{name}"


def parse_job(job: str):
    """``seedS-NAME`` -> (S, NAME)."""
    head, _, name = job.partition("-")
    return int(head.removeprefix("seed")), name


def job_key(args, job: str) -> str:
    """What a job's result depends on (``--reuse`` compares it): the config, the evaluation and,
    for an arm's job, that arm and its overrides (adding an arm reuses the others; changing an
    arm's definition runs it again)."""
    cfg = args.train_config
    d = {"job": job, "config": {k: v for k, v in cfg.as_dict().items()
                                if k not in ("seed", "fitset_cache", "out", "report_dir", "quiet")},
         "eval_n": args.eval_n, "sampled_n": args.sampled_n, "eval_seed": args.eval_seed,
         "samples": args.samples, "threads": args.threads, "version": 4}
    if args.select != "last":    # the key of every earlier run stays what it was
        d["select"] = args.select
    arm = ARM_BY_NAME.get(parse_job(job)[1]) if job != BASE else None
    if arm is not None and arm.overrides:   # ADMM-ring's (none) keeps the key it had
        d["overrides"] = list(arm.overrides)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- one job
def eval_argv(args, cfg, *, sampled: bool, n: int) -> List[str]:
    argv = ["--task", cfg.task, "--model_name", cfg.model_name, "--seed", str(args.eval_seed),
            "--n", str(n), "--n_agents", str(cfg.n_agents), "--prompt", cfg.prompt,
            "--max_new_tokens", str(cfg.max_new_tokens), "--batch_size", str(max(cfg.gen_batch_size, 64)),
            "--adapt_roles", cfg.adapt_roles, "--device", "cpu", "--dtype", cfg.dtype]
    if cfg.task_path:
        argv += ["--task_path", cfg.task_path]
    if cfg.n_ops is not None:
        argv += ["--n_ops", str(cfg.n_ops)]
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


def score_rows(args, cfg, deploy_argv: List[str], *, greedy_n: int, sampled_n: int) -> Dict[str, List[float]]:
    """Per-row accuracy: greedy on the front ``greedy_n`` rows and, when ``sampled_n`` > 0,
    sampled (``--samples`` chains a row) on the front ``sampled_n``: the share of right chains."""
    from admm_dist.cli.evaluate import build_parser
    from admm_dist.mas import evaluation as evaluate

    out = {}
    for mode, rows in (("greedy", greedy_n), ("sampled", sampled_n)):
        if rows <= 0:
            continue
        ev = build_parser().parse_args(eval_argv(args, cfg, sampled=mode == "sampled", n=rows) + deploy_argv)
        _, chains, outcome = evaluate.run(ev)
        per = 1 if mode == "greedy" else args.samples
        right = [float(bool(o["correct"])) for o in outcome]
        out[mode] = [sum(right[i:i + per]) / per for i in range(0, len(right), per)]
        out[mode + "_anchors"] = [str(it["anchor"]) for it, _ in chains[::per]]
    return out


def eval_rows(args) -> Dict[str, int]:
    """The row counts of a base or arm evaluation: greedy on ``--eval_n``, sampled on the front
    ``--sampled_n`` when ``--samples`` asks for sampled chains."""
    return {"greedy_n": args.eval_n, "sampled_n": args.sampled_n if args.samples else 0}


def train_arm(cfg) -> Dict[str, object]:
    """One Trainer run in this process; a refused result is a result, not a crash of the
    benchmark (any other bad setting stops the benchmark)."""
    from admm_dist.engine.dist import distributed
    from admm_dist.training.outputs import RefusedError
    from admm_dist.training.trainer import Trainer

    t0 = time.time()
    try:
        with distributed(cfg.device, timeout_s=cfg.timeout_s) as ctx:
            report = Trainer(cfg, ctx, log=lambda m: None).train()
    except RefusedError as e:
        return {"refused": str(e), "train_sec": round(time.time() - t0, 2)}
    rounds = report.get("rounds") or []
    return {"refused": None, "train_sec": round(time.time() - t0, 2), "best": report.get("best"),
            "f": [r["f"] for r in rounds], "primal_normalized": [r["primal_normalized"] for r in rounds],
            "primal": [r["primal"] for r in rounds], "dual": [r["dual"] for r in rounds],
            "delta_w_rel": report.get("delta_w_rel"), "node_sizes": report.get("node_sizes"),
            # the arm's own later collections (recollect_every), under its own adapter
            "recollections": [{k: c.get(k) for k in COLLECTION_KEYS} for c in report.get("collections") or []
                              if c.get("collection", 0) > 0]}


def first_collection(cfg) -> Dict[str, object]:
    """The stats of the seed's shared first collection (its fitset_cache file, written by the
    seed's first arm, read by every other)."""
    from admm_dist.data.fitset import load_fitset

    stats = (load_fitset(cfg.fitset_cache).stats if cfg.fitset_cache and os.path.isfile(cfg.fitset_cache)
             else {})
    return {k: stats.get(k) for k in COLLECTION_KEYS}


def consensus_file(cfg, select: str) -> str:
    """The file a consensus arm deploys: ``<out>-last`` or ``<out>-best`` (``--select``)."""
    return f"{cfg.out}-{select}.safetensors"


def deployed_vectors(cfg, arm: Arm, select: str) -> Dict[int, "object"]:
    """{seat: the flat vector that arm deploys on it} (for distances between arms)."""
    from safetensors.torch import load_file

    if arm.deploy == "consensus":
        vec = load_file(consensus_file(cfg, select))["b"]
        return {s: vec for s in cfg.adapted_seats()}
    with open(os.path.join(cfg.out, "seat_map.json")) as fh:
        node_of = json.load(fh)["node_of_seat"]
    key = "x" if cfg.local_only else "z"
    return {int(s): load_file(os.path.join(cfg.out, f"node-{n}.safetensors"))[key]
            for s, n in node_of.items()}


def run_job(args, job: str) -> Dict[str, object]:
    """One worker's job: the base's rows (and, for a chain, the untrained single seat's greedy
    rows: the model alone, on the same questions), a seed's first collection (a dry run that writes the
    seed's ``fitset_cache``, which every arm of the seed then reads), or one arm of one seed:
    trained, evaluated, and for a consensus arm that collects again, its learning curve."""
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.time()
    out: Dict[str, object] = {"job": job, "key": job_key(args, job)}
    if job == BASE:
        out["rows"] = score_rows(args, args.train_config, [], **eval_rows(args))
        if args.train_config.n_agents > 1:   # what a user compares a trained chain with: the model alone
            out["single"] = score_rows(args, args.train_config, ["--n_agents", "1"], greedy_n=args.eval_n,
                                       sampled_n=0)
    else:
        seed, name = parse_job(job)
        out["seed"] = seed
        if name == COLLECT:
            cfg = dataclasses.replace(base_config(args, seed), dry_run=True)
            train_arm(cfg)
            out["collection"] = first_collection(cfg)
        else:
            out["arm"] = name
            out["result"] = run_arm(args, seed, ARM_BY_NAME[name])
    out["seconds"] = round(time.time() - t0, 2)
    return out


def refused_job(args, job: str) -> Optional[Dict[str, object]]:
    """An arm's job whose settings its arm refuses (e.g. rho_adapt on an ablation), as that job's
    result, decided without starting a worker; None for any job that must run."""
    if job == BASE:
        return None
    seed, name = parse_job(job)
    if name == COLLECT:
        return None
    try:
        base_config(args, seed, ARM_BY_NAME[name])
    except BenchError as e:   # that arm is refused, not the run
        return {"job": job, "key": job_key(args, job), "seed": seed, "arm": name,
                "result": {"refused": str(e)}, "seconds": 0.0}
    return None


def run_arm(args, seed: int, arm: Arm) -> Dict[str, object]:
    cfg = base_config(args, seed, arm)
    res = train_arm(cfg)
    if res["refused"] is None:
        report = os.path.join(cfg.report_dir, f"{os.path.basename(cfg.out)}-train.json")
        deploy = (["--adapter", consensus_file(cfg, args.select)] if arm.deploy == "consensus"
                  else ["--deploy", "local", "--state", cfg.out])
        res["rows"] = score_rows(args, cfg, deploy + ["--train_report", report], **eval_rows(args))
        if cfg.recollect_every and arm.deploy == "consensus":
            res["curve"] = score_curve(args, cfg, res["rows"]["greedy"], report)
    return res


def assemble_seed(args, seed: int, collect: dict, arm_jobs: Dict[str, dict]) -> Dict[str, object]:
    """A seed's result from its jobs: every arm's collections (the shared first one, then the
    arm's own) and its deployed vectors' distances to Centralized."""
    first = collect["collection"]
    arms: Dict[str, dict] = {}
    vectors = {}
    for arm in (a for a in ARMS if a.name in args.arm_list):
        res = dict(arm_jobs[arm.name]["result"])
        if res.get("refused") is None:
            res["collection"] = first
            res["collections"] = [first] + res.pop("recollections")
            vectors[arm.name] = deployed_vectors(base_config(args, seed, arm), arm, args.select)
        arms[arm.name] = res
    ref = vectors.get("Centralized")
    if ref:
        for name, vec in vectors.items():
            d = [float((vec[s] - ref[s]).norm() / ref[s].norm().clamp_min(1e-30)) for s in sorted(ref)]
            arms[name]["distance_to_centralized"] = d
    return {"seed": seed, "arms": arms,
            "seconds": round(collect["seconds"] + sum(j["seconds"] for j in arm_jobs.values()), 2)}
