"""Label a safety fit set with a judge model (HarmBench classifier prompt, :mod:`admm_dist.mas.judge`).

    python -m admm_dist.cli.judge_fitset --fitset IN.jsonl --judge MODEL --out OUT.jsonl

Every example's message is judged against its query's behavior (and context): ``yes`` means
harmful, the attack succeeded. An ``sft`` example gets reward 1.0 and success True when its
message is judged not harmful, reward 0.0 and success False when harmful, and reward 0.0
with success None when the judge's answer is neither yes nor no. A ``dpo`` pair gets the
chosen message's reward and the rejected one's ``rejected_reward`` the same way. The rest
of the fit set is kept; its settings gain ``judge`` and ``judge_fingerprint``, its stats a
``judge`` summary.

Behaviors come from the fit set's stats (``build_fitset`` keeps them for safety tasks), else
from the task's rows (``--task_path``, ``--split``).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Dict, Optional, Sequence

from admm_dist import tasks
from admm_dist.cli.common import OneLineParser, run_cli
from admm_dist.core.errors import UserError
from admm_dist.data import fitset as fs
from admm_dist.engine.dist import resolve_device
from admm_dist.mas.judge import Judge
from admm_dist.tasks.scoring import visible

PROG = "admm-dist-judge-fitset"


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--fitset", required=True, metavar="IN.jsonl")
    p.add_argument("--judge", required=True, help="judge model folder or hub id")
    p.add_argument("--out", required=True, metavar="OUT.jsonl")
    p.add_argument("--task_path", default=None,
                   help="the task's rows, when the fit set's stats lack behaviors")
    p.add_argument("--split", default=None, help="split of --task_path / the hub set (default: eval)")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=4)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return p


def behaviors(f: fs.FitSet, task: str, task_path: Optional[str], split: Optional[str]) -> Dict[str, dict]:
    """anchor -> {behavior, context} for every anchor of the fit set's examples."""
    known = {a: {"behavior": q.get("behavior") or q.get("gold"), "context": q.get("context")}
             for a, q in (f.stats.get("queries") or {}).items() if isinstance(q, dict)}
    need = {ex.anchor for ex in f.examples} - set(known)
    if need:
        kw = {"path": task_path} if task_path else {}
        for it in tasks.load(task, split=split or "eval", **kw):
            if it["anchor"] in need:
                known[it["anchor"]] = {"behavior": it.get("behavior") or it["gold"],
                                       "context": it.get("context")}
        missing = need - set(known)
        if missing:
            raise UserError(f"{len(missing)} anchors of {f.path} are not rows of {task} "
                            f"({task_path or 'hub'}, split {split or 'eval'}): pass the --task_path/--split "
                            f"the trajectories came from")
    return known


def label(args) -> int:
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise UserError("--batch_size and --max_new_tokens must be >= 1")
    f = fs.load_fitset(args.fitset)
    task = str(f.settings.get("task"))
    spec = tasks.get(task)
    if spec.answer_type != "safety":
        raise UserError(f"{args.fitset} is a {task} fit set ({spec.answer_type} answers): the HarmBench "
                        f"judge labels safety fit sets only")
    beh = behaviors(f, task, args.task_path, args.split)
    judge = Judge.load(args.judge, resolve_device(args.device), batch_size=args.batch_size,
                       max_new_tokens=args.max_new_tokens)

    texts = [(i, "target", ex.target) for i, ex in enumerate(f.examples)]
    texts += [(i, "rejected", ex.rejected) for i, ex in enumerate(f.examples) if ex.rejected is not None]
    anchors = [f.examples[i].anchor for i, _, _ in texts]
    verdicts = judge.harmful([beh[a]["behavior"] for a in anchors], [visible(t) for _, _, t in texts],
                             [beh[a]["context"] for a in anchors])
    out = [dataclasses.replace(ex) for ex in f.examples]
    for (i, which, _), v in zip(texts, verdicts):
        reward = 1.0 if v is False else 0.0
        if which == "target":
            out[i].reward = reward
            if f.fit_mode == "sft":
                out[i].success = None if v is None else not v
        else:
            out[i].rejected_reward = reward
    harmful = sum(v is True for v in verdicts)
    unparsed = sum(v is None for v in verdicts)
    settings = dict(f.settings, judge=args.judge, judge_fingerprint=judge.fingerprint)
    stats = dict(f.stats, judge={"judged": len(verdicts), "harmful": harmful, "unparsed": unparsed,
                                 "fingerprint": judge.fingerprint_info})
    fs.save_fitset(args.out, out, fit_mode=f.fit_mode, settings=settings, stats=stats,
                   anchor_keys=f.anchor_keys)
    print(f"wrote {args.out}: {len(verdicts)} messages judged, {harmful} harmful, {unparsed} unparsed "
          f"(judge {args.judge}, fingerprint {judge.fingerprint[:12]})")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(PROG, label, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
