"""Evaluate the multi-agent chain on a task's evaluation rows, with or without trained adapters.

    python -m admm_dist.evaluate --task chain_arith --model_name assets/standin --n 400 \\
        [--adapter runs/admm-last.safetensors | --deploy local --state runs/admm] \\
        [--agent_models 1=PATH] [--save_trajectories T.jsonl] [--json S.json]
    python -m admm_dist.evaluate --config runs/admm/config.yaml --state runs/admm --n 400

``--config`` takes the settings evaluation shares with training (task, model, chain, prompt,
generation, seed, device) from a training config or a run's ``<out>/config.yaml``; the chain is
prompted with the run's ``fit_prompt`` when it has one. Flags given override the file. A run
that trained on a pre-built fit set (``task: fitset``) names no task: pass ``--task`` then.

Rows are the front of the task pool shuffled by ``--seed`` (:mod:`admm_dist.data.queries`), rows
``[offset, offset + n)``. What runs on the adapted seats (``--adapt_roles``):

- nothing: the bare backbone;
- ``--adapter FILE``: one saved vector (``<out>-last`` / ``-best``) on every adapted seat; the
  adapter is rebuilt from the identity stored in the file and checked against the backbone;
- ``--state DIR`` (a training run's ``<out>`` folder): ``--deploy local`` gives each seat its
  own node's state by ``seat_map.json`` (x_i for a ``local_only`` run, else z_i);
  ``--deploy consensus`` gives every seat the consensus z (refused when the run says
  ``deploy_required: local``).

``--agent_models SEAT=PATH`` runs a seat on another backbone (a compromised agent); such a
seat carries no adapter. Reasoning tasks report accuracy; safety tasks are judged with
``--judge`` (:mod:`admm_dist.mas.judge`) and report the attack success rate.

Leakage: rows whose anchor key the training report lists are refused. The report is
``--train_report``, else the one named in the adapter's metadata or found next to the run
(``<report_dir>/<name>-train.json``); if none is found the check is skipped with a note.
Bad input is one line on stderr and exit code 2.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from admm_dist import tasks
from admm_dist.core.errors import UserError
from admm_dist.core.io import atomic_write_bytes, atomic_write_json, check_output_file, read_json
from admm_dist.data import queries
from admm_dist.engine.dist import check_device, resolve_device
from admm_dist.mas import ChainConfig, ChainRunner, role_name
from admm_dist.mas.judge import Judge
from admm_dist.mas.seats import adapted_seats, parse_agent_models
from admm_dist.mas.vllm_backend import VLLMBackend, require_vllm
from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
from admm_dist.model.loading import check_model_src, load_model
from admm_dist.model.vectors import load_vector
from admm_dist.tasks.sandbox import isolation
from admm_dist.tasks.scoring import visible


# --------------------------------------------------------------------------- deployed states
@dataclasses.dataclass
class Deploy:
    """What the adapted seats run with, read from files before any backbone loads."""
    adapter_config: object                       # AdapterConfig
    vectors: Callable[[object], Dict[int, torch.Tensor]]   # adapter -> {seat: vector}
    describe: str
    run_config: dict
    report: Optional[str]
    anchor_keys: Optional[List[str]] = None   # the training queries the file itself lists


def adapter_config_of_run(cfg: dict):
    keys = ("lora_rank", "lora_alpha", "lora_layers_last", "lora_targets")
    if not all(k in cfg for k in keys):
        raise UserError("the run's seat_map.json has no adapter settings (lora_*) in its config: "
                        "it was not written by the trainer")
    seed = cfg.get("lora_basis_seed")
    return AdapterConfig(**{k: cfg[k] for k in keys},
                         lora_basis_seed=cfg.get("seed", 42) if seed is None else seed)


def find_report(candidates: Sequence[Optional[str]]) -> Optional[str]:
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def run_reports(run_cfg: dict, run_dir: str) -> List[str]:
    """Where the trainer put the run's report: <report_dir>/<name>-train.json."""
    name = os.path.basename(str(run_cfg.get("out") or run_dir).rstrip("/"))
    rd = str(run_cfg.get("report_dir", "results"))
    parent = os.path.dirname(os.path.abspath(run_dir))
    return [os.path.join(rd, f"{name}-train.json"), os.path.join(parent, rd, f"{name}-train.json"),
            os.path.join(parent, f"{name}-train.json")]


def from_adapter(path: str, deploy: str, seats: Callable[[dict], List[int]]) -> Deploy:
    if deploy == "local":
        raise UserError("--deploy local gives each seat its own node's state: pass --state DIR (the run's "
                        "<out> folder) instead of --adapter")
    _, meta = load_vector(path)
    ident = meta.get("adapter")
    if not isinstance(ident, dict) or not isinstance(ident.get("config"), dict):
        raise UserError(f"--adapter {path} carries no adapter identity: re-save it with save_vector(..., "
                        "adapter=)")
    if meta.get("deploy_required") == "local":
        raise UserError(f"--adapter {path}: its run has no exact consensus (gossip or local_only): evaluate "
                        f"the run folder with --deploy local --state DIR")
    stem = path
    for suffix in ("-last.safetensors", "-best.safetensors", ".safetensors"):
        if path.endswith(suffix):
            stem = path[:-len(suffix)]
            break
    seat_map = os.path.join(stem, "seat_map.json")
    run_cfg = (read_json(seat_map, "seat map").get("config") or {}) if os.path.isfile(seat_map) else {}
    report = find_report([meta.get("report")] + run_reports(run_cfg, stem))

    def vectors(adapter):   # the file's backbone (its weight digest) must be the one loaded
        vec, _ = load_vector(path, expect=adapter, backbone=True)
        return {s: vec for s in seats(run_cfg)}
    return Deploy(AdapterConfig.from_dict(ident["config"]), vectors, f"adapter {path}", run_cfg, report,
                  _keys(meta.get("anchor_keys")))


def from_state(folder: str, deploy: str, n_agents: int, seats: Callable[[dict], List[int]]) -> Deploy:
    from safetensors import safe_open
    from safetensors.torch import load_file

    sm = read_json(os.path.join(folder, "seat_map.json"), "seat map")
    cfg, node_of = sm.get("config"), sm.get("node_of_seat")
    if not isinstance(cfg, dict) or not isinstance(node_of, dict):
        raise UserError(f"{folder}/seat_map.json lacks config or node_of_seat: it was not written by the "
                        "trainer")
    if cfg.get("n_agents", n_agents) != n_agents:
        raise UserError(f"--state {folder} was trained on a chain of {cfg['n_agents']} seats: pass "
                        f"--n_agents {cfg['n_agents']}")
    if deploy == "consensus" and sm.get("deploy_required") == "local":
        raise UserError(f"--state {folder}: the run has no exact consensus (gossip or local_only): use "
                        "--deploy local")
    key = "x" if deploy == "local" and cfg.get("local_only") else "z"
    want = seats(cfg)
    missing = [s for s in want if str(s) not in node_of]
    if missing:
        raise UserError(f"--state {folder}: seats {missing} have no node in seat_map.json (the run adapted "
                        f"seats {sorted(int(s) for s in node_of)}): choose --adapt_roles to match")

    def node_vector(seat: int) -> torch.Tensor:
        node = node_of[str(seat)]
        path = os.path.join(folder, f"node-{node}.safetensors")
        if not os.path.isfile(path):
            raise UserError(f"--state {folder}: {os.path.basename(path)} (seat {seat}'s node) is missing")
        try:
            tensors = load_file(path)
            with safe_open(path, framework="pt") as fh:
                meta = fh.metadata() or {}
        except Exception as exc:
            raise UserError(f"{path} is not a readable safetensors file ({type(exc).__name__})") from None
        written = meta.get("round")
        if written is not None and sm.get("round") is not None and str(sm["round"]) != written:
            raise UserError(f"{path} holds round {written} but the run's seat_map.json is of round "
                            f"{sm['round']}: a stale file (its rank could not write the final one); finish "
                            "the run with resume=auto first")
        # a node file copied from another node's name, or another run's, is refused like a stale one
        if meta.get("node") is not None and meta["node"] != str(node):
            raise UserError(f"{path} holds node {meta['node']}'s state, not node {node}'s: it was copied "
                            "from another file; restore the run's own node files (or train again)")
        if meta.get("fingerprint") and sm.get("fingerprint") and meta["fingerprint"] != sm["fingerprint"]:
            raise UserError(f"{path} was written by another run (fingerprint {meta['fingerprint']}, the seat "
                            f"map's {sm['fingerprint']}): restore the run's own node files (or train again)")
        if key not in tensors:
            raise UserError(f"{path} holds no {key!r} tensor (keys {sorted(tensors)}): not a node state file")
        return tensors[key]

    def vectors(adapter):
        out = {}
        for s in want:
            out[s] = node_vector(s if deploy == "local" else want[0])
            adapter.load_vector(out[s])   # checks the size: another backbone or config is an AdapterError
        return out
    return Deploy(adapter_config_of_run(cfg), vectors, f"state {folder} ({deploy}, {key})", cfg,
                  find_report(run_reports(cfg, folder)), _keys(sm.get("anchor_keys")))


def _keys(value) -> Optional[List[str]]:
    return [str(k) for k in value] if isinstance(value, list) else None


def report_task(rep: dict) -> Optional[str]:
    """The task a training report's run trained on: its ``config.task`` when that is a registered
    task, else (a run on a pre-built fit set, whose ``task`` is only a label such as ``fitset``)
    the ``task`` its fit set was built from when that is one; else None (the task is unknown)."""
    cfg = rep.get("config") if isinstance(rep.get("config"), dict) else {}
    fit = rep.get("fitset_settings") if isinstance(rep.get("fitset_settings"), dict) else {}
    return next((t for t in (cfg.get("task"), fit.get("task")) if isinstance(t, str) and t in tasks.REGISTRY),
                None)


def check_report_task(path: str, task: str) -> None:
    """Refuse a ``--train_report`` of a run on another task than the one evaluated (its anchor keys
    would not guard these rows); a report whose task is unknown (:func:`report_task`) is kept."""
    theirs = report_task(read_json(path, "training report"))
    if theirs is not None and theirs != task:
        raise UserError(f"--train_report {path} is the report of a run on task {theirs}, but this evaluates "
                        f"task {task}: pass the report of the {task} run (or --task {theirs})")


def train_keys(path: str) -> List[str]:
    rep = read_json(path, "training report")
    keys = rep.get("anchor_keys")
    if not isinstance(keys, list):
        raise UserError(f"training report {path} lists no anchor_keys: pass the <name>-train.json the "
                        "trainer wrote")
    return [str(k) for k in keys]


# --------------------------------------------------------------------------- the run
def check_numbers(args) -> None:
    if args.n is not None and args.n < 1:
        raise UserError(f"--n {args.n}: evaluate at least one row")
    if args.offset < 0:
        raise UserError(f"--offset {args.offset} must be >= 0")
    if args.samples < 1:
        raise UserError(f"--samples {args.samples} must be >= 1")
    if not args.temperature >= 0:
        raise UserError(f"--temperature {args.temperature} must be >= 0 (0 = greedy)")
    if args.samples > 1 and args.temperature == 0:
        raise UserError("--samples > 1 needs --temperature > 0 (greedy chains are all the same)")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p {args.top_p} must be in (0, 1]")
    if args.adapter and args.state:
        raise UserError("pass --adapter FILE or --state DIR, not both")
    if args.deploy == "local" and not args.state:
        raise UserError("--deploy local needs --state DIR (the training run's <out> folder)")
    check_device(args.device)


def prepare(args):
    """Everything that can be checked before a backbone loads: the task, the deployed states,
    the models named, the rows, the leakage check and the output paths."""
    check_numbers(args)
    for flag, path in (("--json", args.json), ("--save_trajectories", args.save_trajectories)):
        if path:
            check_output_file(path, flag)
    spec = tasks.get(args.task)
    safety = spec.answer_type == "safety"
    if safety and not args.judge:
        raise UserError(f"task {args.task} is a safety task scored by a judge: pass --judge MODEL "
                        f"(e.g. cais/HarmBench-Llama-2-13b-cls)")
    if args.judge and not safety:
        raise UserError(f"--judge is for safety tasks; {args.task} is scored by its {spec.answer_type} "
                        "answers")
    if spec.answer_type == "code":   # no sandbox, no scoring: say so before any model loads
        isolation()
    if args.train_report:   # another task's report would guard nothing: say so before any work
        check_report_task(args.train_report, args.task)
    n = args.n_agents
    if n < 1:
        raise UserError(f"--n_agents {n}: a chain needs at least one seat")

    def seats(run_cfg: dict) -> List[int]:
        return adapted_seats(args.adapt_roles or run_cfg.get("adapt_roles") or "all", n)
    dep = (from_adapter(args.adapter, args.deploy, seats) if args.adapter else
           from_state(args.state, args.deploy, n, seats) if args.state else None)
    run_cfg = dep.run_config if dep else {}
    model_name = args.model_name or run_cfg.get("model_name")
    if not model_name:
        raise UserError("pass --model_name (a backbone folder or hub id)")
    agent_models = parse_agent_models(args.agent_models, n)   # ValueError: one line, exit 2
    for src, what in [(model_name, "--model_name"), (args.judge, "--judge")] + \
            [(p, "--agent_models") for p in agent_models.values()]:
        if src:
            check_model_src(src, what)
    chain = ChainConfig(n_agents=n, prompt=args.prompt, words=spec.words, think=args.think,
                        context_tokens=args.text_mas_context_length, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_p=args.top_p, batch_size=args.batch_size)
    items = queries.pool(args.task, seed=args.seed, split=args.split, path=args.task_path, n_ops=args.n_ops)
    if args.offset >= len(items):   # rows [offset, end) would be empty: nothing to score
        raise UserError(f"--offset {args.offset}: task {args.task} has {len(items)} rows in split "
                        f"{args.split or 'eval'}: pass an --offset below {len(items)}")
    rows = queries.evaluation_rows(items, args.n, offset=args.offset)
    report = args.train_report or (dep.report if dep else None)
    if report:
        queries.refuse_leaks(rows, train_keys(report), report=report)
    if dep and dep.anchor_keys is not None:   # a copied adapter still knows what it trained on
        queries.refuse_leaks(rows, dep.anchor_keys, report=dep.describe)
    settings = {"config": getattr(args, "config", None), "model_name": model_name, "seed": args.seed,
                "split": args.split or "eval",
                "task_path": args.task_path, "n_ops": args.n_ops, "n_agents": n, "prompt": args.prompt,
                "words": spec.words,
                "think": args.think, "text_mas_context_length": args.text_mas_context_length,
                "adapt_roles": args.adapt_roles or run_cfg.get("adapt_roles") or "all",
                "deploy": dep.describe if dep else None,
                "agent_models": {str(s): p for s, p in agent_models.items()},
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "samples": args.samples, "batch_size": args.batch_size, "train_report": report,
                "generation_backend": args.generation_backend, "dtype": args.dtype,
                "leakage_checked_by_file": bool(dep and dep.anchor_keys is not None)}
    return safety, dep, agent_models, chain, rows, settings


def roll_out(args, dep, agent_models, chain, rows, settings, device):
    """Load the backbones and adapters and run every chain: [(item, Rollout)], adapted seats."""
    if args.generation_backend == "vllm":
        require_vllm()
    model, tok = load_model(settings["model_name"], device, dtype=args.dtype)
    adapter, states = None, {}
    if dep:
        adapter = BOnlyLoRA(model, dep.adapter_config)
        states = {s: v for s, v in dep.vectors(adapter).items() if s not in agent_models}
        model = adapter.model
    others = {p: load_model(p, device, what="--agent_models", dtype=args.dtype)
              for p in sorted(set(agent_models.values()))}
    generator = None
    if args.generation_backend == "vllm":
        generator = VLLMBackend(settings["model_name"], tok, adapter, seed=args.seed, dtype=args.dtype)
    try:
        runner = ChainRunner(model, tok, chain, adapter=adapter, seat_states=states,
                             seat_models={s: others[p] for s, p in agent_models.items()}, generator=generator,
                             progress="evaluate")
        results = runner.run(rows, samples=args.samples, seed=args.seed, greedy=args.temperature == 0)
    finally:
        if generator is not None:
            generator.close()
    return [(item, r) for item, rs in zip(rows, results) for r in rs], sorted(states)


def judge_chains(src: str, chains, device, batch_size: int):
    """Safety outcome per chain from the judge's verdict on the final message."""
    judge = Judge.load(src, device, batch_size=batch_size)
    verdicts = judge.harmful([str(it.get("behavior") or it["gold"]) for it, _ in chains],
                             [visible(r.final_text) for _, r in chains],
                             [it.get("context") or None for it, _ in chains])
    return judge.fingerprint, [{"prediction": None, "harmful": v, "judge_answer": a,
                                "correct": None if v is None else not v} for v, a in zip(verdicts, judge.raw)]


def run(args):
    """Roll out and score: (summary, chains, outcome), one outcome per chain (in row order,
    ``--samples`` chains per row)."""
    t0 = time.time()
    safety, dep, agent_models, chain, rows, settings = prepare(args)
    device = resolve_device(args.device)
    chains, adapted = roll_out(args, dep, agent_models, chain, rows, settings, device)
    settings.update(adapted_seats=adapted, device=str(device))
    if safety:
        if device.type == "cuda":   # the chain's backbones are gone: make room for the judge
            gc.collect()
            torch.cuda.empty_cache()
        settings["judge"] = args.judge
        settings["judge_fingerprint"], outcome = judge_chains(args.judge, chains, device, args.batch_size)
    else:
        outcome = []
        for it, r in chains:
            pred, ok = tasks.score(args.task, r.final_text, it)
            outcome.append({"prediction": pred, "correct": bool(ok)})
    total, split = len(chains), settings["split"]
    summary = {"task": args.task, "split": split, "rows": [args.offset, args.offset + len(rows)],
               "n": len(rows), "n_chains": total}
    if safety:
        hits = sum(o["harmful"] is True for o in outcome)
        unparsed = sum(o["harmful"] is None for o in outcome)
        summary.update(attack_success_rate=hits / total, harmful=hits, judge_unparsed=unparsed)
    else:
        hits = sum(bool(o["correct"]) for o in outcome)
        summary.update(accuracy=hits / total, correct=hits)
    summary.update(settings=settings, seconds=round(time.time() - t0, 2))
    return summary, chains, outcome


def evaluate(args) -> int:
    summary, chains, outcome = run(args)
    settings = summary["settings"]
    if args.save_trajectories:
        write_trajectories(args.save_trajectories, args.task, chains, outcome, settings["adapted_seats"],
                           {int(k): v for k, v in settings["agent_models"].items()}, settings)
    lo, hi = summary["rows"]
    where = f"on {args.task} {summary['split']} rows [{lo}, {hi})"
    total = summary["n_chains"]
    if "attack_success_rate" in summary:
        hits, unparsed = summary["harmful"], summary["judge_unparsed"]
        line = f"attack success rate {hits / total:.3f} ({hits}/{total}) {where}" + (
            f" ({unparsed} judge answers unparsed)" if unparsed else "")
    else:
        line = f"accuracy {summary['accuracy']:.3f} ({summary['correct']}/{total}) {where}"
    if args.json:
        atomic_write_json(args.json, summary)
    if settings["deploy"] and not settings["train_report"] and not settings["leakage_checked_by_file"]:
        print(f"note: no training report found for {settings['deploy']}: leakage not checked "
              "(pass --train_report)", file=sys.stderr)
    print(line)
    if args.json:
        print(f"wrote {args.json}")
    return 0


def write_trajectories(path: str, task: str, chains, outcome: List[dict], adapted: List[int],
                       agent_models: Dict[int, str], settings: dict) -> None:
    """One JSON object per chain (see build_fitset for the reader)."""
    keep = ("model_name", "prompt", "words", "think", "text_mas_context_length", "n_agents", "seed",
            "temperature", "top_p")
    lines = []
    for (item, r), out in zip(chains, outcome):
        msgs = [{"seat": s, "role": role_name(s), "prompt": p, "text": t, "finished": f,
                 "adapted": s in adapted, "model": agent_models.get(s, settings["model_name"])}
                for s, (p, t, f) in enumerate(zip(r.prompts, r.texts, r.finished))]
        rec = {"task": task, "anchor": item["anchor"], "question": item["question"], "gold": item["gold"],
               "answer_type": item.get("answer_type"), "sample": r.sample}
        for extra in ("behavior", "context"):
            if item.get(extra):
                rec[extra] = item[extra]
        rec.update(messages=msgs, final=r.final_text, **out,
                   settings={k: settings[k] for k in keep})
        lines.append(json.dumps(rec, ensure_ascii=False, allow_nan=False))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))
