"""``python -m admm_dist.cli.synthetic --out DIR``: a tiny random Qwen3 backbone and synthetic
fit sets in DIR (:mod:`admm_dist.demo.synthetic`, :mod:`admm_dist.demo.tiny`)."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from transformers import AutoTokenizer

from admm_dist.cli.common import OneLineParser
from admm_dist.demo import synthetic
from admm_dist.demo.tiny import save_tiny_backbone


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = OneLineParser(prog="python -m admm_dist.cli.synthetic", description=synthetic.__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for backbone/ and fitset-*.jsonl")
    p.add_argument("--n_agents", type=int, default=4)
    p.add_argument("--per_seat", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", default="synthetic")
    a = p.parse_args(argv)
    bb = save_tiny_backbone(os.path.join(a.out, "backbone"), seed=a.seed)
    tok = AutoTokenizer.from_pretrained(bb)
    for mode in ("dpo", "sft"):
        synthetic.write_fitset(os.path.join(a.out, f"fitset-{mode}.jsonl"), fit_mode=mode,
                     per_seat=a.per_seat, seed=a.seed, tokenizer=tok,
                     settings={"task": a.task, "n_agents": a.n_agents, "adapt_roles": "all"})
    print(f"wrote {a.out}/backbone and {a.out}/fitset-{{dpo,sft}}.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
