"""The stand-in backbone: a tiny Qwen3 trained from scratch on ``chain_arith``, and its check.

The real backbone is an 8B model on GPUs. Tests and the CPU default need one that loads
offline in a second, answers partly right and partly wrong when sampled, and goes through
the same code paths: a real ``Qwen3ForCausalLM`` with a character-level tokenizer that
carries a chat template, prompted by the real chain runtime (:mod:`admm_dist.mas`).

``train`` teaches it each seat's job in the chain, on the exact prompts the runtime
builds (mode ``sequential_v2``, wording ``compact``): seat k applies the k-th operation
of the question to the number stated by seat k-1, and the last seat states the answer.
In a share of the training chains one upstream seat states a wrong number and the later
seats carry on from it, so every seat reads its input from the previous message rather
than recomputing the chain. Training stops at a fixed step, deliberately at partial
competence, so sampled chains are right on some tries and wrong on others. It is
deterministic: the same seed and thread count give the same bytes.

    python -m admm_dist.cli.standin train --out assets/standin          # about 3-4 min on 2 cores
    python -m admm_dist.cli.standin check [--json PATH] [--model DIR]

``check`` reports, on held-out ``chain_arith`` questions through the full chain: sampled
accuracy, the share of questions with mixed outcomes, greedy accuracy, and for each seat
how often replacing its message with a wrong one changes the final answer.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from admm_dist.core import io as aio
from admm_dist.core.errors import UserError
from admm_dist.mas import ChainConfig, ChainRunner
from admm_dist.tasks.chain_arith import apply_op, load_chain_arith, score_chain_arith
from admm_dist.tasks.scoring import extract_number, visible
from admm_dist.demo.tiny import char_tokenizer, tiny_qwen3

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "assets" / "standin"   # admm_dist/demo/ -> repo
PROMPT, WORDS = "sequential_v2", "compact"
MAX_NEW_TOKENS = 16


def default_model_dir() -> str:
    if not (DEFAULT_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the shipped stand-in backbone is not at {DEFAULT_DIR}: pass --model DIR, "
                                f"or build it with `python -m admm_dist.cli.standin train --out DIR`")
    return str(DEFAULT_DIR)


def chain_config(n_agents: int = 4, **kw) -> ChainConfig:
    """The chain settings the stand-in is trained and checked under."""
    kw.setdefault("max_new_tokens", MAX_NEW_TOKENS)
    return ChainConfig(n_agents=n_agents, prompt=PROMPT, words=WORDS, **kw)


# --------------------------------------------------------------------------- data
def seat_message(seat: int, n_agents: int, value_in: int, op: str) -> Tuple[str, int]:
    """Seat ``seat``'s correct message given the number it reads, and the number it states."""
    if seat == n_agents - 1:
        return f"Answer: {value_in}", value_in
    out = apply_op(value_in, op[0], int(op[1:]))
    return f"{value_in}{op}={out}", out


def training_chain(item: dict, n_agents: int, rng: random.Random,
                   corrupt_p: float) -> Tuple[List[Tuple[int, List[str], str]], int]:
    """(seat, upstream messages, target) for every seat of one chain, and the seat whose
    message was corrupted (-1: none): with probability ``corrupt_p`` one working seat's
    message states a wrong number, and the later seats carry on from it."""
    bad_seat = rng.randrange(n_agents - 1) if n_agents > 1 and rng.random() < corrupt_p else -1
    history: List[str] = []
    value, out = int(item["start"]), []
    for seat in range(n_agents):
        op = item["ops"][seat] if seat < n_agents - 1 else ""
        text, value = seat_message(seat, n_agents, value, op)
        out.append((seat, list(history), text))
        if seat == bad_seat:
            value += rng.choice([-1, 1]) * rng.randint(1, 10)
            text = f"{text.split('=')[0]}={value}"
        history.append(text)
    return out, bad_seat


def _examples(tok, runner: ChainRunner, items: Sequence[dict], n_agents: int, rng: random.Random,
              corrupt_p: float) -> List[Tuple[List[int], List[bool]]]:
    """One example per chain (seats in turn): the token ids of prompt + target + end of
    turn, and which positions carry the loss: the target, and every upstream message that
    is a correct step (the backbone learns arithmetic from those too; a corrupted one is
    never a label)."""
    texts, spans = [], []
    for i, it in enumerate(items):
        chain, bad = training_chain(it, n_agents, rng, corrupt_p)
        seat, hist, target = chain[i % n_agents]
        prompt = runner.prompt_text(seat, it, hist)
        texts.append(prompt + target + tok.eos_token)
        sp, cur = [(len(prompt), len(texts[-1]))], prompt.index("\n", prompt.index(str(it["question"])))
        for j, line in enumerate(hist):
            at = prompt.find("\n" + line + "\n", cur)
            if at < 0:
                raise ValueError(f"upstream message {line!r} is not in the prompt: the wording changed")
            cur = at + len(line) + 1
            if j != bad:
                sp.append((at + 1, cur))
        spans.append(sp)
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for ids, offs, sp in zip(enc["input_ids"], enc["offset_mapping"], spans):
        out.append((ids, [any(a <= s0 and e0 <= b for a, b in sp) and e0 > s0 for s0, e0 in offs]))
    return out


def _batch(examples: Sequence[Tuple[List[int], List[bool]]], pad: int) -> Tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in examples)
    x = torch.full((len(examples), width), pad, dtype=torch.long)
    y = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for r, (ids, lab) in enumerate(examples):
        row = torch.tensor(ids)
        x[r, :len(ids)] = row
        y[r, :len(ids)] = torch.where(torch.tensor(lab), row, torch.full_like(row, -100))
        mask[r, :len(ids)] = 1
    return x, y, mask


# --------------------------------------------------------------------------- training
RECIPE = dict(steps=600, batch=128, lr=3e-3, warmup=50, schedule_steps=1200, hidden=128, layers=2,
              heads=4, intermediate=512, corrupt_p=0.3, weight_decay=0.01, n_agents=4,
              stop_greedy=0.45, probe_from=200, probe_every=25, probe_n=100)
# Competence arrives suddenly (greedy chain accuracy went 0.36 -> 0.50 -> 0.85 at steps
# 250, 300, 350 in one run), so training stops at the first probe where the greedy chain
# accuracy on held-out training-region questions reaches ``stop_greedy``, rather than at
# a fixed step: deterministic, and robust to where exactly the jump falls.


def train(out: str, *, seed: int = 0, threads: int = 2, log_every: int = 50,
          snapshot_every: int = 0, log=print, **overrides) -> Dict[str, object]:
    """Train the stand-in from scratch and write it (safetensors, config, tokenizer) to ``out``."""
    unknown = set(overrides) - set(RECIPE)
    if unknown:
        raise UserError(f"unknown recipe keys {sorted(unknown)}: use {', '.join(RECIPE)}")
    rc = dict(RECIPE, **overrides)
    torch.set_num_threads(threads)
    t0 = time.time()
    tok = char_tokenizer()
    model = tiny_qwen3(len(tok), hidden=rc["hidden"], layers=rc["layers"], heads=rc["heads"],
                       intermediate=rc["intermediate"], seed=seed, max_positions=512)
    model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.train()
    runner = ChainRunner(None, tok, chain_config(rc["n_agents"]))
    per_step = rc["batch"]
    items = load_chain_arith("train", n=per_step * rc["steps"] + rc["probe_n"], seed=seed,
                             n_ops=rc["n_agents"] - 1)
    probe = items[per_step * rc["steps"]:]           # never trained on
    probes: List[Tuple[int, float]] = []
    rng = random.Random(f"standin|{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=rc["lr"], weight_decay=rc["weight_decay"])

    def lr_at(step: int) -> float:
        if step < rc["warmup"]:
            return rc["lr"] * (step + 1) / rc["warmup"]
        frac = (step - rc["warmup"]) / max(1, rc["schedule_steps"] - rc["warmup"])
        return rc["lr"] * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    losses = []
    for step in range(rc["steps"]):
        chunk = items[step * per_step:(step + 1) * per_step]
        x, y, mask = _batch(_examples(tok, runner, chunk, rc["n_agents"], rng, rc["corrupt_p"]),
                            tok.pad_token_id)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=x, attention_mask=mask, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            log(f"[standin] step {step + 1}/{rc['steps']} loss {sum(losses[-log_every:]) / log_every:.4f} "
                f"({time.time() - t0:.0f}s)")
        if snapshot_every and (step + 1) % snapshot_every == 0 and step + 1 < rc["steps"]:
            save(f"{out}-step{step + 1}", model, tok, {"recipe": dict(rc, steps=step + 1), "seed": seed,
                                                       "threads": threads})
        if (step + 1) >= rc["probe_from"] and (step + 1) % rc["probe_every"] == 0 and probe:
            acc = _greedy_chain_acc(model, tok, probe, rc["n_agents"])
            probes.append((step + 1, acc))
            log(f"[standin] step {step + 1}: greedy chain accuracy {acc:.3f} on {len(probe)} held-out "
                "questions")
            if acc >= rc["stop_greedy"]:
                break
    model.eval()
    info = {"recipe": rc, "seed": seed, "threads": threads, "final_loss": losses[-1] if losses else None,
            "stopped_at": len(losses), "probes": probes,
            "seconds": round(time.time() - t0, 1), "torch": torch.__version__, "prompt": PROMPT,
            "words": WORDS}
    save(out, model, tok, info)
    return info


def _greedy_chain_acc(model, tok, items: Sequence[dict], n_agents: int) -> float:
    model.eval()
    try:
        runs = ChainRunner(model, tok, chain_config(n_agents, batch_size=len(items))).run(items, greedy=True)
    finally:
        model.train()
    return sum(score_chain_arith(r[0].final_text, it)[1] for r, it in zip(runs, items)) / len(items)


def save(out: str, model, tok, info: Dict[str, object]) -> None:
    """Write the folder atomically: a temp folder, then one rename."""
    import shutil

    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    card = {k: v for k, v in info.items() if k != "seconds"}   # keep the folder's bytes reproducible
    aio.atomic_write_bytes(os.path.join(tmp, "standin.json"),
                           (json.dumps(card, indent=2, sort_keys=True) + "\n").encode())
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o644)   # readable by whoever runs the job
    aio.replace_dir(tmp, out)


def folder_digest(folder: str) -> Dict[str, str]:
    """sha256 of every file in a folder (what 'the same bytes' is checked against)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as fh:
            out[name] = hashlib.sha256(fh.read()).hexdigest()
    return out


# --------------------------------------------------------------------------- check
def load(folder: Optional[str] = None, device: str = "cpu"):
    """(model, tokenizer) from a stand-in folder, offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    folder = folder or default_model_dir()
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"{folder} holds no model (config.json missing): pass the folder "
                                f"`python -m admm_dist.cli.standin train` wrote")
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    return model.to(device).eval(), tok


def wrong_message(text: str, rng: random.Random) -> str:
    """``text`` with its last stated number moved by a nonzero amount."""
    vis = visible(text)
    num = extract_number(vis)
    if num is None:
        return f"{text} {rng.randint(1, 99)}"
    new = str(int(float(num)) + rng.choice([-1, 1]) * rng.randint(1, 10))
    head, sep, tail = vis.rpartition(num)
    return text[:len(text) - len(vis)] + head + new + tail if sep else f"{text} {new}"


def check(folder: Optional[str] = None, *, n: int = 400, samples: int = 8, temperature: float = 0.8,
          top_p: float = 0.95, seed: int = 0, n_agents: int = 4, batch_size: int = 256,
          threads: Optional[int] = None) -> Dict[str, object]:
    if threads:
        torch.set_num_threads(threads)
    t0 = time.time()
    model, tok = load(folder)
    items = load_chain_arith("eval", n=n, seed=seed, n_ops=n_agents - 1)
    runner = ChainRunner(model, tok, chain_config(n_agents, temperature=temperature, top_p=top_p,
                                                  batch_size=batch_size))
    sampled = runner.run(items, samples=samples, seed=seed)
    right = [[score_chain_arith(r.final_text, it)[1] for r in rs] for it, rs in zip(items, sampled)]
    per_q = [sum(r) for r in right]
    greedy = [rs[0] for rs in runner.run(items, greedy=True)]
    base = [score_chain_arith(g.final_text, it)[0] for g, it in zip(greedy, items)]
    rng = random.Random(f"standin-check|{seed}")
    influence = []
    for seat in range(n_agents):
        hist = [g.texts[:seat] + [wrong_message(g.texts[seat], rng)] for g in greedy]
        cont = runner.continue_chains(items, hist, lambda r, s: None)
        influence.append(sum(score_chain_arith(c.final_text, it)[0] != b
                             for c, b, it in zip(cont, base, items)) / len(items))
    seat_ok = []   # each working seat's own step, given its actual input (greedy)
    for seat in range(n_agents - 1):
        ok = 0
        for g, it in zip(greedy, items):
            got = extract_number(g.texts[seat])
            src = it["start"] if seat == 0 else extract_number(g.texts[seat - 1])
            try:
                ok += got is not None and int(got) == apply_op(int(src), it["ops"][seat][0],
                                                               int(it["ops"][seat][1:]))
            except (TypeError, ValueError):
                pass
        seat_ok.append(ok / len(items))
    return {
        "sampled_acc": sum(per_q) / (len(items) * samples),
        "mixed_share": sum(0 < k < samples for k in per_q) / len(items),
        "greedy_acc": sum(b == it["gold"] for b, it in zip(base, items)) / len(items),
        "seat_influence": influence,
        "seat_step_acc_greedy": seat_ok,
        "n_questions": len(items), "samples": samples, "temperature": temperature, "top_p": top_p,
        "seed": seed, "model": os.path.abspath(folder or default_model_dir()),
        "seconds": round(time.time() - t0, 1),
    }
