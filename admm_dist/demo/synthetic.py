"""Synthetic fit sets for tests, benchmarks and the small CPU configs (no data set is downloaded).

``make_examples`` builds, for every seat of the chain, preference pairs (or SFT
targets) on small arithmetic queries: the prompt is the seat's chat-formatted
turn, the chosen message states the right sum and the rejected one a wrong
sum in a hedged style. ``python -m admm_dist.cli.synthetic --out DIR`` writes a tiny random Qwen3
backbone and such a fit set into DIR.
"""
from __future__ import annotations

import random
from typing import Dict, List

from admm_dist.data.fitset import Example, save_fitset
from admm_dist.mas.prompts import role_name


def _prompt(tokenizer, role: str, question: str) -> str:
    msgs = [{"role": "system", "content": f"You are the {role}."},
            {"role": "user", "content": question}]
    if tokenizer is not None:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs) \
        + "<|im_start|>assistant\n"


def make_examples(*, n_agents: int = 4, per_seat: int = 32, fit_mode: str = "dpo",
                  seed: int = 0, tokenizer=None, think: bool = False) -> List[Example]:
    rng = random.Random(seed)
    out: List[Example] = []
    for i in range(per_seat):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        anchor = f"q{seed}-{i}"
        question = f"{a}+{b}=?"
        for seat in range(n_agents):
            role = role_name(seat)
            prompt = _prompt(tokenizer, role, question)
            wrong = a + b + rng.choice([-11, -10, -1, 1, 10, 11])
            pre = "<think>add</think>" if think else ""
            # A learnable preference even for a random tiny model: a stated right answer
            # over a hedged wrong one.
            good, bad = f"{pre}The sum is {a + b}.", f"{pre}maybe {wrong}?"
            if fit_mode == "dpo":
                out.append(Example(seat=seat, role=role, anchor=anchor, prompt=prompt, target=good,
                                   rejected=bad, reward=1.0, rejected_reward=0.0, advantage=1.0))
            else:
                for text, ok in ((good, True), (bad, False)):
                    out.append(Example(seat=seat, role=role, anchor=anchor, prompt=prompt,
                                       target=text, reward=float(ok), success=ok,
                                       advantage=1.0 if ok else -1.0))
    return out


def write_fitset(path: str, *, settings: Dict[str, object], fit_mode: str = "dpo",
                 per_seat: int = 32, seed: int = 0, tokenizer=None) -> str:
    n_agents = int(settings.get("n_agents", 4))
    ex = make_examples(n_agents=n_agents, per_seat=per_seat, fit_mode=fit_mode, seed=seed,
                       tokenizer=tokenizer)
    save_fitset(path, ex, fit_mode=fit_mode, settings=settings,
                stats={"source": "admm_dist.synthetic", "per_seat": per_seat},
                anchor_keys=sorted({e.anchor for e in ex}))
    return path
