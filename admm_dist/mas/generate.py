"""Batched generation where every row draws from its own seeded stream.

``generate`` runs ``model.generate`` greedily over logits that a processor has turned into
a sample: temperature, then top-p, then Gumbel noise from a per-row ``torch.Generator``
(argmax of logits/T + Gumbel is an exact draw from softmax(logits/T)). Each row's noise
comes from its own seed, so a row's sample does not depend on which other rows share its
batch or on its position there. ``seed=None`` for a row means greedy decoding.

Rows are batched in the order given (left padding), ``batch_size`` at a time, so a fixed
list of prompts always meets the same batch shapes and gives the same bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence

import torch


@dataclasses.dataclass
class Generation:
    text: str          # the new text, up to (not including) the end-of-turn token
    finished: bool     # ended with the end-of-turn token (not cut by the budget)
    n_tokens: int


class RowSeededSampler:
    """A logits processor: temperature, top-p, then per-row Gumbel noise (greedy rows untouched)."""

    def __init__(self, seeds: Sequence[Optional[int]], temperature: float, top_p: float):
        if temperature <= 0:
            raise ValueError("temperature must be > 0 for sampling; use seed=None rows for greedy")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} must be in (0, 1]")
        self.gens = [None if s is None else torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature, self.top_p = float(temperature), float(top_p)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows = [i for i, g in enumerate(self.gens) if g is not None]
        if not rows:
            return scores
        scores = scores.float().clone()
        s = scores[rows] / self.temperature
        vocab = s.shape[-1]
        u = torch.stack([torch.rand(vocab, generator=self.gens[i], dtype=torch.float64) for i in rows])
        if self.top_p >= 1.0:
            gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
            scores[rows] = s + gumbel.to(s.device, s.dtype)
            return scores
        keep = self.nucleus(s)
        noisy = torch.full_like(s, float("-inf"))
        # the kept tokens' noise only, picked on the host (u's device), so a GPU gets those, not the
        # vocabulary
        gumbel = -torch.log(-torch.log(u[keep.to(u.device)].clamp_min(1e-300)))
        noisy[keep] = s[keep] + gumbel.to(s.device, s.dtype)
        scores[rows] = noisy
        return scores

    TOP_K = 256     # the nucleus is looked for among this many tokens first

    def nucleus(self, s: torch.Tensor) -> torch.Tensor:
        """Where each row keeps its token: the fewest most likely tokens whose probability
        reaches top_p (a token is dropped when the mass before it is >= top_p, so at least one
        stays). Found among the top :attr:`TOP_K` logits (one partial selection: a sort of
        SmolLM2's 49k vocabulary for 32 rows cost about half the model's CPU decoding step);
        a row whose nucleus reaches past them is sorted whole."""
        probs = torch.softmax(s, dim=-1)
        k = min(self.TOP_K, s.shape[-1])
        _, idx = torch.topk(s, k, dim=-1)
        p = probs.gather(-1, idx)
        drop = (p.cumsum(-1) - p) >= self.top_p
        keep = torch.zeros_like(s, dtype=torch.bool).scatter(-1, idx, ~drop)
        wide = ~drop[:, -1] if k < s.shape[-1] else torch.zeros(s.shape[0], dtype=torch.bool, device=s.device)
        if wide.any():
            order = torch.sort(s[wide], descending=True, dim=-1).indices
            p = probs[wide].gather(-1, order)
            drop = (p.cumsum(-1) - p) >= self.top_p
            keep[wide] = torch.zeros_like(order, dtype=torch.bool).scatter(-1, order, ~drop)
        return keep


IM_END = "<|im_end|>"    # the ChatML end of turn (Qwen3, SmolLM2)


def stop_ids(tokenizer, model) -> List[int]:
    """The end-of-turn ids: the tokenizer's eos, ``model.generation_config``'s eos, ``<|im_end|>``."""
    ids = []
    for cand in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        for x in (cand if isinstance(cand, (list, tuple)) else [cand]):
            if x is not None and x not in ids:
                ids.append(int(x))
    im_end = tokenizer.convert_tokens_to_ids(IM_END) if IM_END in tokenizer.get_vocab() else None
    if im_end is not None and im_end not in ids:
        ids.append(int(im_end))
    if not ids:
        raise ValueError("the tokenizer has no end-of-turn token (eos_token): set one so generation can stop")
    return ids


def end_of_turn_text(tokenizer) -> str:
    """The text of the token that ends an assistant message: ``<|im_end|>`` where the vocabulary
    has it (the chat templates of Qwen3 and SmolLM2), else the tokenizer's eos; one of
    :func:`stop_ids`, and mapped back to that token when a fit target is tokenised."""
    if IM_END in tokenizer.get_vocab():
        return IM_END
    if not tokenizer.eos_token:
        raise ValueError("the tokenizer has no end-of-turn token (eos_token): set one so generation can stop")
    return tokenizer.eos_token


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[str], *, seeds: Sequence[Optional[int]],
             max_new_tokens: int, temperature: float = 0.8, top_p: float = 0.95,
             batch_size: int = 64, on_batch: Optional[Callable[[int], None]] = None) -> List[Generation]:
    """One completion per prompt (prompts are already chat-formatted text); ``on_batch(n)``
    after each batch of n prompts (a progress bar's update)."""
    from transformers import GenerationConfig, LogitsProcessorList

    if len(seeds) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    if max_new_tokens <= 0:
        return [Generation("", False, 0) for _ in prompts]
    stop = stop_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    device = next(model.parameters()).device
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: List[Generation] = []
    try:
        for lo in range(0, len(prompts), batch_size):
            batch, bseeds = list(prompts[lo:lo + batch_size]), list(seeds[lo:lo + batch_size])
            enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
            procs = []
            if any(s is not None for s in bseeds):
                procs.append(RowSeededSampler(bseeds, temperature, top_p))
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                   pad_token_id=pad, eos_token_id=stop)
            ids = model.generate(input_ids=enc["input_ids"].to(device),
                                 attention_mask=enc["attention_mask"].to(device),
                                 generation_config=cfg, logits_processor=LogitsProcessorList(procs))
            new = ids[:, enc["input_ids"].shape[1]:].tolist()
            for row in new:
                cut = next((j for j, t in enumerate(row) if t in stop), None)
                toks = row if cut is None else row[:cut]
                out.append(Generation(tokenizer.decode(toks, skip_special_tokens=False),
                                      cut is not None, len(toks) + (cut is not None)))
            if on_batch is not None:
                on_batch(len(batch))
    finally:
        tokenizer.padding_side = old_side
    return out
