"""Saved chain trajectories -> an ``sft`` fit set (one example per adapted seat's message).

    python -m admm_dist.cli.build_fitset --trajectories T.jsonl [T2.jsonl ...] \\
        --out FITSET.jsonl --n_agents 4 --adapt_roles all [--fit_prompt MODE]

Reads the files ``admm_dist.evaluate --save_trajectories`` writes (one chain per line). Each
adapted seat's message becomes an :class:`~admm_dist.data.fitset.Example`: the prompt the seat
saw, its message as the target, reward 1.0 / 0.0 and success from the chain's ``correct``
(success None and reward 0.0 when the chain carries no verdict). ``--fit_prompt`` re-renders
every prompt under another prompt mode (e.g. a hardened ``*_v2s``) from the same upstream
messages, keeping the message as the target; it needs the backbone's tokenizer
(``--model_name``, default the one the trajectories name).

The fit set's settings are ``{task, n_agents, adapt_roles, sampling_structure:
"actual_trajectory"}``; its anchor keys are the trajectories' anchors. For safety tasks the
stats keep each anchor's behavior and context, which ``judge_fitset`` needs.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional, Sequence

from admm_dist.cli.common import OneLineParser, run_cli
from admm_dist.core.errors import UserError
from admm_dist.core.io import read_jsonl
from admm_dist.data import fitset as fs
from admm_dist.mas import ChainConfig, ChainRunner, prompt_modes, role_name
from admm_dist.mas.seats import ROLE_SETS, adapted_seats

PROG = "admm-dist-build-fitset"


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--trajectories", nargs="+", required=True, metavar="FILE.jsonl")
    p.add_argument("--out", required=True, metavar="FITSET.jsonl")
    p.add_argument("--n_agents", type=int, default=4)
    p.add_argument("--adapt_roles", choices=ROLE_SETS, default="all")
    p.add_argument("--fit_prompt", choices=prompt_modes(), default=None,
                   help="re-render every prompt under this prompt mode")
    p.add_argument("--model_name", default=None,
                   help="tokenizer for --fit_prompt (default: the trajectories')")
    return p


def read_chains(paths: Sequence[str], n_agents: int) -> List[dict]:
    chains, task = [], None
    for path in paths:
        for i, rec in enumerate(read_jsonl(path, "trajectories"), 1):
            where = f"{path}: chain {i}"
            msgs = rec.get("messages")
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("text"), str)
                                                     and isinstance(m.get("prompt"), str) for m in msgs):
                raise UserError(f"{where} has no messages with prompt and text: not a trajectory file "
                                f"(write one with admm_dist.evaluate --save_trajectories)")
            if not isinstance(rec.get("anchor"), str) or not isinstance(rec.get("task"), str):
                raise UserError(f"{where} has no anchor or task")
            if len(msgs) != n_agents:
                raise UserError(f"{where} has {len(msgs)} seats but --n_agents is {n_agents}")
            if task is not None and rec["task"] != task:
                raise UserError(f"{where} is task {rec['task']} but earlier chains are {task}: one task per "
                                "fit set")
            if rec.get("correct") not in (True, False, None):
                raise UserError(f"{where}: correct must be true, false or null")
            task = rec["task"]
            chains.append(rec)
    if not chains:
        raise UserError("the trajectory files hold no chains")
    return chains


def refit_prompts(chains: List[dict], mode: str, model_name: Optional[str]) -> Dict[int, List[str]]:
    """Every chain's seat prompts re-rendered under ``mode`` (index in ``chains`` -> prompts)."""
    from transformers import AutoTokenizer


    out: Dict[int, List[str]] = {}
    toks: dict = {}
    for i, rec in enumerate(chains):
        st = rec.get("settings") or {}
        src = model_name or st.get("model_name")
        if not src:
            raise UserError("--fit_prompt needs the backbone's tokenizer: pass --model_name")
        if src not in toks:
            try:
                toks[src] = AutoTokenizer.from_pretrained(src, local_files_only=os.path.isdir(src))
            except Exception as exc:
                raise UserError(f"cannot load the tokenizer of {src} ({type(exc).__name__}): "
                                f"pass --model_name") from None
        cfg = ChainConfig(n_agents=len(rec["messages"]), prompt=mode, words=st.get("words", "default"),
                          think=bool(st.get("think")), context_tokens=st.get("text_mas_context_length"))
        runner = ChainRunner(None, toks[src], cfg)
        item = {"question": rec.get("question", ""), "answer_type": rec.get("answer_type") or "number"}
        texts = [m["text"] for m in rec["messages"]]
        out[i] = [runner.prompt_text(s, item, texts) for s in range(len(texts))]
    return out


def build(args) -> int:
    chains = read_chains(args.trajectories, args.n_agents)
    seats = adapted_seats(args.adapt_roles, args.n_agents)
    prompts = refit_prompts(chains, args.fit_prompt, args.model_name) if args.fit_prompt else {}
    examples, anchors, queries = [], {}, {}
    for i, rec in enumerate(chains):
        ok = rec.get("correct")
        anchors.setdefault(rec["anchor"], None)
        if rec.get("answer_type") == "safety":
            queries[rec["anchor"]] = {k: rec.get(k) for k in ("question", "gold", "behavior", "context")}
        for s in seats:
            m = rec["messages"][s]
            examples.append(fs.Example(seat=s, role=role_name(s), anchor=rec["anchor"],
                                       prompt=prompts[i][s] if prompts else m["prompt"], target=m["text"],
                                       reward=1.0 if ok else 0.0, success=ok))
    task = chains[0]["task"]
    labelled = [c["correct"] for c in chains if c.get("correct") is not None]
    stats = {"source": "trajectories", "trajectory_files": list(args.trajectories), "n_chains": len(chains),
             "n_examples": len(examples), "labelled_chains": len(labelled),
             "success_rate": sum(labelled) / len(labelled) if labelled else None,
             "prompt": (chains[0].get("settings") or {}).get("prompt"), "fit_prompt": args.fit_prompt}
    if queries:
        stats["queries"] = queries
    settings = {"task": task, "n_agents": args.n_agents, "adapt_roles": args.adapt_roles,
                "sampling_structure": "actual_trajectory"}
    fs.save_fitset(args.out, examples, fit_mode="sft", settings=settings, stats=stats,
                   anchor_keys=list(anchors))
    print(f"wrote {args.out}: {len(examples)} examples from {len(chains)} chains (seats {seats})")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(PROG, build, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
