"""Tokenisation and batching for the node objectives (docs/design.md section 3).

Owns :class:`Encoded` / :class:`EncodedSet` (the tokenised examples of one node, with their
per-token masks and, once :func:`admm_dist.model.objectives.precompute_reference` has run,
their reference log-probs), :func:`encode`, :class:`Batch`, :func:`collate` and
:func:`batches`. The losses on these batches live in :mod:`admm_dist.model.objectives`.

Tokenisation (:func:`encode`)
    Prompt and target are tokenised separately with ``add_special_tokens=False`` (the prompt
    already carries the chat template; a target that should end with an end-of-turn token
    must contain it as text, which the tokenizer maps to the special token). The prompt is
    truncated from the LEFT to ``max_prompt_tokens`` (the most recent context is kept), the
    target on the RIGHT to ``max_target_tokens``. Each target token has a mask: all ones
    for ``target_span full``; for ``visible`` ones only after the last ``</think>`` token
    of the untruncated target (the rule of :func:`admm_dist.core.text.visible`), all
    ones when the target has no ``</think>``. The mask is computed before truncation, so a
    target cut inside its think block scores nothing rather than scoring its thoughts as
    visible text. Examples left with no scored token (empty target, or an empty visible
    span) and empty prompts are skipped and counted in ``EncodedSet.stats``; for ``rsft``
    examples whose ``success`` is not ``True`` are skipped too (the rule of
    :func:`admm_dist.data.derive.derive`). For ``dpo`` the chosen message is encoded with
    ``prompt`` and the rejected one with ``rejected_prompt or prompt``; the pair is skipped
    if either side is empty.

Batches (:func:`collate`)
    Rows are prompt + target, RIGHT-padded, so every real token keeps the positions
    ``0..n-1`` it has when scored alone and no position ids are needed. A DPO batch of B
    pairs has 2B rows, the B chosen rows first, then the B rejected rows in the same
    order: chosen and rejected are scored by one batched forward. Only target tokens are
    scored: target token j of a row with a prompt of length p sits at position p + j and is
    predicted by the logits at position p + j - 1. Reference log-probs stored on the
    records are copied into the batch; for ``grpo``, so are the sampling policy's log-probs and
    each message's advantage (its group-normalised reward: :func:`admm_dist.data.derive.derive`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

from admm_dist.core.errors import UserError
from admm_dist.core.text import THINK_CLOSE

log = logging.getLogger(__name__)


class Encoding(Protocol):
    """The fields :func:`encode` reads of a config (:class:`~admm_dist.model.objectives.ObjectiveConfig`,
    whose module imports this one)."""
    fit_mode: str
    target_span: str
    max_prompt_tokens: int
    max_target_tokens: int

    @property
    def paired(self) -> bool: ...


# ----------------------------------------------------------------------------- encoding

@dataclasses.dataclass(eq=False)
class Encoded:
    """One tokenised example. ``*_mask`` are 0/1 per target token; ``*ref_logps`` are the
    reference per-token log-probs (float32 CPU tensors of the target's length, 0 where the
    mask is 0), filled by
    :func:`admm_dist.model.objectives.precompute_reference`."""
    example_index: int               # position of the example in the list given to encode()
    role: str
    prompt_ids: List[int]
    target_ids: List[int]
    target_mask: List[int]
    rejected_prompt_ids: Optional[List[int]] = None
    rejected_ids: Optional[List[int]] = None
    rejected_mask: Optional[List[int]] = None
    ref_logps: Optional[torch.Tensor] = None
    rejected_ref_logps: Optional[torch.Tensor] = None
    advantage: float = 0.0           # grpo: the message's group advantage
    sample_logps: Optional[torch.Tensor] = None   # grpo: the sampling policy's, like ref_logps

    @property
    def paired(self) -> bool:
        return self.rejected_ids is not None

    @property
    def has_reference(self) -> bool:
        return self.ref_logps is not None and (not self.paired or self.rejected_ref_logps is not None)

    def rows(self) -> List[Tuple[List[int], List[int], List[int], Optional[torch.Tensor]]]:
        """(prompt, target, mask, ref) per scored sequence: chosen first, then rejected."""
        out = [(self.prompt_ids, self.target_ids, self.target_mask, self.ref_logps)]
        if self.paired:
            out.append((self.rejected_prompt_ids, self.rejected_ids, self.rejected_mask,
                        self.rejected_ref_logps))
        return out


class EncodedSet(list):
    """A ``list`` of :class:`Encoded` with ``stats``: counts of examples given, kept,
    skipped (by reason), and kept examples whose prompt (either prompt of a pair) or
    target (either message of a pair) was truncated."""

    def __init__(self, items: Iterable[Encoded] = (), stats: Optional[Dict[str, int]] = None):
        super().__init__(items)
        self.stats: Dict[str, int] = dict(stats or {})


def _think_close_id(tokenizer) -> int:
    tid = tokenizer.convert_tokens_to_ids(THINK_CLOSE)
    ids = tokenizer(THINK_CLOSE, add_special_tokens=False)["input_ids"]
    if tid is None or tid == tokenizer.unk_token_id or ids != [tid]:
        raise UserError(f"target_span visible needs a tokenizer with a single {THINK_CLOSE!r} "
                        f"token; this one encodes it as {ids}: use target_span full")
    return int(tid)


def _span_mask(ids: Sequence[int], span: str, close_id: Optional[int]) -> List[int]:
    """0/1 per token of ``ids``: all ones for ``full``; for ``visible`` ones only after the
    last ``close_id`` (all ones when there is none)."""
    if span == "full":
        return [1] * len(ids)
    try:
        k = len(ids) - 1 - list(ids)[::-1].index(close_id)     # the LAST </think>
    except ValueError:
        return [1] * len(ids)
    return [0] * (k + 1) + [1] * (len(ids) - k - 1)


def encode(tokenizer, examples: Sequence[Any], cfg: Encoding) -> EncodedSet:
    """Tokenise ``examples`` (:class:`admm_dist.data.fitset.Example` or anything with its field
    names) for ``cfg.fit_mode``; see the module docstring for the rules. Returns an
    :class:`EncodedSet` (a list) whose ``stats`` count what was skipped and truncated."""
    stats = {"examples": len(examples), "kept": 0, "skipped_empty_prompt": 0,
             "skipped_empty_target": 0, "skipped_empty_rejected": 0,
             "skipped_not_successful": 0, "prompt_truncated": 0, "target_truncated": 0}
    close_id = _think_close_id(tokenizer) if cfg.target_span == "visible" else None
    if cfg.paired:
        missing = [i for i, ex in enumerate(examples) if getattr(ex, "rejected", None) is None]
        if missing:
            raise UserError(f"fit_mode dpo needs a rejected message on every example; "
                            f"example {missing[0]} (and {len(missing) - 1} more) has none: "
                            f"use fit_mode sft, or derive dpo pairs from the fit set")
    chosen = list(examples)
    if cfg.fit_mode == "rsft":
        chosen = [ex for ex in chosen if getattr(ex, "success", None) is True]
        stats["skipped_not_successful"] = len(examples) - len(chosen)
    index = {id(ex): i for i, ex in enumerate(examples)}

    # Tokenise each distinct text once, in batches (prompts are often shared).
    texts: Dict[str, List[int]] = {}
    wanted = []
    for ex in chosen:
        wanted += [ex.prompt, ex.target]
        if cfg.paired:
            wanted += [ex.rejected_prompt or ex.prompt, ex.rejected]
    todo = list(dict.fromkeys(t for t in wanted if t not in texts))
    for s in range(0, len(todo), 256):
        part = todo[s:s + 256]
        for t, ids in zip(part, tokenizer(part, add_special_tokens=False, verbose=False)["input_ids"]):
            texts[t] = list(ids)
    prompts: Dict[str, List[int]] = {}   # truncated prompts, shared between records

    def prompt_ids(text: str) -> List[int]:
        if text not in prompts:
            ids = texts[text]
            prompts[text] = ids[len(ids) - cfg.max_prompt_tokens:] \
                if len(ids) > cfg.max_prompt_tokens else ids
        return prompts[text]

    def target(text: str) -> Tuple[List[int], List[int]]:
        ids = texts[text]
        mask = _span_mask(ids, cfg.target_span, close_id)
        if len(ids) > cfg.max_target_tokens:
            ids, mask = ids[:cfg.max_target_tokens], mask[:cfg.max_target_tokens]
        return ids, mask

    out = EncodedSet()
    for ex in chosen:
        p = prompt_ids(ex.prompt)
        t, m = target(ex.target)
        rp = rt = rm = None
        if cfg.paired:
            rp = prompt_ids(ex.rejected_prompt or ex.prompt)
            rt, rm = target(ex.rejected)
        if not p or (cfg.paired and not rp):
            stats["skipped_empty_prompt"] += 1
            continue
        if not any(m):
            stats["skipped_empty_target"] += 1
            continue
        if cfg.paired and not any(rm):
            stats["skipped_empty_rejected"] += 1
            continue
        prompts_in = [ex.prompt] + ([ex.rejected_prompt or ex.prompt] if cfg.paired else [])
        targets_in = [ex.target] + ([ex.rejected] if cfg.paired else [])
        stats["prompt_truncated"] += any(len(texts[x]) > cfg.max_prompt_tokens for x in prompts_in)
        stats["target_truncated"] += any(len(texts[x]) > cfg.max_target_tokens for x in targets_in)
        out.append(Encoded(example_index=index[id(ex)], role=str(ex.role), prompt_ids=p,
                           target_ids=t, target_mask=m, rejected_prompt_ids=rp,
                           rejected_ids=rt, rejected_mask=rm,
                           advantage=float(ex.advantage) if cfg.fit_mode == "grpo" else 0.0))
    stats["kept"] = len(out)
    out.stats = stats
    skipped = {k: v for k, v in stats.items() if k.startswith("skipped_") and v}
    if skipped or stats["prompt_truncated"] or stats["target_truncated"]:
        log.info("encode(%s, span=%s): kept %d of %d; %s; truncated prompts %d, targets %d",
                 cfg.fit_mode, cfg.target_span, stats["kept"], stats["examples"],
                 skipped or "nothing skipped", stats["prompt_truncated"],
                 stats["target_truncated"])
    return out


# ----------------------------------------------------------------------------- batches

@dataclasses.dataclass
class Batch:
    """Right-padded rows ready for one forward. For a paired (dpo) batch of B pairs the
    first B rows are the chosen sequences and the last B the rejected ones, pair k being
    rows k and B + k."""
    input_ids: torch.Tensor          # [R, L] long, prompt + target, right-padded with pad_id
    attention_mask: torch.Tensor     # [R, L] long
    target_ids: torch.Tensor         # [R, T] long, 0 past the target's end
    target_pos: torch.Tensor         # [R, T] long, position of target token j: prompt_len + j
    target_mask: torch.Tensor        # [R, T] float32, 1 where the token is scored
    ref_logps: Optional[torch.Tensor]  # [R, T] float32 or None (not precomputed)
    paired: bool
    example_index: List[int]         # per pair / example (length B)
    roles: List[str]                 # per pair / example (length B)
    sample_logps: Optional[torch.Tensor] = None   # grpo: [R, T] float32, the sampling policy's
    advantages: Optional[torch.Tensor] = None     # grpo: [R] float32, each message's advantage

    @property
    def n_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_examples(self) -> int:
        return len(self.example_index)

    def to(self, device) -> "Batch":
        def mv(t):
            return None if t is None else t.to(device, non_blocking=True)
        return dataclasses.replace(
            self, input_ids=mv(self.input_ids), attention_mask=mv(self.attention_mask),
            target_ids=mv(self.target_ids), target_pos=mv(self.target_pos),
            target_mask=mv(self.target_mask), ref_logps=mv(self.ref_logps),
            sample_logps=mv(self.sample_logps), advantages=mv(self.advantages))

    def chosen(self) -> "Batch":
        """The chosen rows only (itself when not paired), trimmed of all-pad columns."""
        if not self.paired:
            return self
        b = self.n_examples
        L = int(self.attention_mask[:b].sum(1).max())
        T = int((self.target_mask[:b] > 0).any(0).nonzero().max()) + 1
        return Batch(input_ids=self.input_ids[:b, :L], attention_mask=self.attention_mask[:b, :L],
                     target_ids=self.target_ids[:b, :T], target_pos=self.target_pos[:b, :T],
                     target_mask=self.target_mask[:b, :T],
                     ref_logps=None if self.ref_logps is None else self.ref_logps[:b, :T],
                     paired=False, example_index=list(self.example_index),
                     roles=list(self.roles))


def collate(encoded_list: Sequence[Encoded], pad_id: int) -> Batch:
    """Build one right-padded :class:`Batch` (2B rows for B dpo pairs, chosen first)."""
    if not encoded_list:
        raise UserError("collate needs at least one encoded example")
    paired = encoded_list[0].paired
    if any(e.paired != paired for e in encoded_list):
        raise UserError("collate got a mix of dpo pairs and single targets: encode each "
                        "node's examples with one fit_mode")
    rows = [e.rows()[0] for e in encoded_list]
    if paired:
        rows += [e.rows()[1] for e in encoded_list]
    R = len(rows)
    L = max(len(p) + len(t) for p, t, _, _ in rows)
    T = max(len(t) for _, t, _, _ in rows)
    input_ids = torch.full((R, L), int(pad_id), dtype=torch.long)
    attention = torch.zeros((R, L), dtype=torch.long)
    target_ids = torch.zeros((R, T), dtype=torch.long)
    target_pos = torch.zeros((R, T), dtype=torch.long)
    target_mask = torch.zeros((R, T), dtype=torch.float32)
    with_ref = all(ref is not None for *_, ref in rows)
    ref_logps = torch.zeros((R, T), dtype=torch.float32) if with_ref else None
    for r, (p, t, m, ref) in enumerate(rows):
        if not p:
            raise UserError("an encoded row has an empty prompt: its first target token "
                            "has nothing to be predicted from (encode() skips these)")
        n, k = len(p), len(t)
        input_ids[r, :n + k] = torch.tensor(p + t, dtype=torch.long)
        attention[r, :n + k] = 1
        target_ids[r, :k] = torch.tensor(t, dtype=torch.long)
        target_pos[r, :k] = torch.arange(n, n + k)
        target_mask[r, :k] = torch.tensor(m, dtype=torch.float32)
        if with_ref:
            ref_logps[r, :k] = ref
    sample_logps = advantages = None
    if not paired and all(e.sample_logps is not None for e in encoded_list):   # grpo
        sample_logps = torch.zeros((R, T), dtype=torch.float32)
        for r, e in enumerate(encoded_list):
            sample_logps[r, :len(e.target_ids)] = e.sample_logps
        advantages = torch.tensor([e.advantage for e in encoded_list], dtype=torch.float32)
    return Batch(input_ids=input_ids, attention_mask=attention, target_ids=target_ids,
                 target_pos=target_pos, target_mask=target_mask, ref_logps=ref_logps,
                 paired=paired, example_index=[e.example_index for e in encoded_list],
                 roles=[e.role for e in encoded_list], sample_logps=sample_logps, advantages=advantages)


def batches(encoded: Sequence[Encoded], batch_size: int, pad_id: int) -> Iterator[Batch]:
    """Consecutive batches of ``encoded`` in order (e.g. a dev set for :func:`nll`)."""
    for s in range(0, len(encoded), batch_size):
        yield collate(encoded[s:s + batch_size], pad_id)
