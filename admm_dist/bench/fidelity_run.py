"""The per-seed run of the learning benchmark (``python -m admm_dist.bench.fidelity``).

It owns the arms (:data:`ARMS`: name, config overrides, how each deploys), the benchmark's
error (:class:`BenchError`), each arm's config (:func:`base_config`) and what a job's result
depends on (:func:`job_key`, compared by ``--reuse``), and one job (:func:`run_job`): the
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
    role: str                 # what the seed's Table 2 makes of it


ARMS = (
    Arm("ADMM-ring", (), "consensus", "consensus ADMM, exact mean over a ring (the default)"),
    Arm("ADMM-gossip", ("consensus=gossip",), "local", "inexact consensus by neighbour mixing"),
    Arm("ADMM-decentralized", ("consensus=decentralized",), "local",
        "node-based decentralized ADMM: one neighbour exchange per round, exact at convergence"),
    Arm("ADMM-ring-int8", ("compress=int8",), "consensus", "ADMM-ring with int8 payloads (0.27x the bytes)"),
    Arm("ADMM-decentralized-int8", ("consensus=decentralized", "compress=int8"), "local",
        "ADMM-decentralized with int8 payloads"),
    Arm("Centralized", ("pooled=true", "consensus=coordinator"), "consensus",
        "every example on one node: the pooled optimum ADMM approaches"),
    Arm("ADMM-Local", ("local_only=true",), "local", "ablation: no coupling, each seat alone"),
    Arm("ADMM-NoDual", ("no_dual=true",), "consensus", "ablation: penalty method, u stays 0"),
)
ARM_NAMES = tuple(a.name for a in ARMS)
BASE = "base"
REFERENCE = "ADMM-ring"
COLLECTION_KEYS = ("kept_queries", "examples", "mean_pass_rate", "mixed_group_rate")


class BenchError(UserError):
    """Bad benchmark input; the message names the fix."""


# --------------------------------------------------------------------------- settings
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
    from admm_dist.cli.evaluate import build_parser
    from admm_dist.mas import evaluation as evaluate

    out = {}
    for mode in ("greedy", "sampled") if args.samples else ("greedy",):
        ev = build_parser().parse_args(eval_argv(args, cfg, sampled=mode == "sampled") + deploy_argv)
        _, chains, outcome = evaluate.run(ev)
        per = 1 if mode == "greedy" else args.samples
        right = [float(bool(o["correct"])) for o in outcome]
        out[mode] = [sum(right[i:i + per]) / per for i in range(0, len(right), per)]
        out[mode + "_anchors"] = [str(it["anchor"]) for it, _ in chains[::per]]
    return out


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
    return {"refused": None, "train_sec": round(time.time() - t0, 2),
            "f": [r["f"] for r in rounds], "primal_normalized": [r["primal_normalized"] for r in rounds],
            "primal": [r["primal"] for r in rounds], "dual": [r["dual"] for r in rounds],
            "delta_w_rel": report.get("delta_w_rel"), "node_sizes": report.get("node_sizes"),
            "collection": {k: report.get("collection", {}).get(k) for k in COLLECTION_KEYS},
            # every collection of this arm: the first is the seed's shared one (collected by
            # whichever job got there first, read from fitset_cache by the others), later ones
            # (recollect_every) ran under the arm's own adapter
            "collections": [{k: c.get(k) for k in COLLECTION_KEYS} for c in
                            [_first_collection(cfg)] + [c for c in report.get("collections") or []
                                                        if c.get("collection", 0) > 0]]}


def _first_collection(cfg) -> Dict[str, object]:
    """The stats of the seed's shared first collection (its fitset_cache file)."""
    from admm_dist.data.fitset import load_fitset

    return load_fitset(cfg.fitset_cache).stats if cfg.fitset_cache and os.path.isfile(cfg.fitset_cache) else {}


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
