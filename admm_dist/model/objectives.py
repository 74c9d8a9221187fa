"""Node objectives f_i (DESIGN.md section 4): DPO, SFT and rejection-sampled SFT with a KL term.

Pipeline, for one node's examples::

    enc = encode(tokenizer, examples, cfg)               # token ids + per-token masks
    precompute_reference(model, enc, batch_size=8,       # reference log-probs, ONCE
                         ref_context=model.disable_adapter)
    sampler = RoleBalancedSampler(enc, batch_size, seed)
    batch = collate([enc[i] for i in sampler.next_batch()], tokenizer.pad_token_id)
    f, metrics = loss(model, batch, cfg)                  # f_i, the value ADMM reports

Tokenisation (:func:`encode`)
    Prompt and target are tokenised separately with ``add_special_tokens=False`` (the prompt
    already carries the chat template; a target that should end with an end-of-turn token
    must contain it as text, which the tokenizer maps to the special token). The prompt is
    truncated from the LEFT to ``max_prompt_tokens`` (the most recent context is kept), the
    target on the RIGHT to ``max_target_tokens``. Each target token has a mask: all ones
    for ``target_span full``; for ``visible`` ones only after the first ``</think>`` token
    of the untruncated target (the rule of :func:`admm_dist.data.fitset.visible_text`), all
    ones when the target has no ``</think>``. The mask is computed before truncation, so a
    target cut inside its think block scores nothing rather than scoring its thoughts as
    visible text. Examples left with no scored token (empty target, or an empty visible
    span) and empty prompts are skipped and counted in ``EncodedSet.stats``; for ``rsft``
    examples whose ``success`` is not ``True`` are skipped too (the rule of
    :func:`admm_dist.data.fitset.derive`). For ``dpo`` the chosen message is encoded with
    ``prompt`` and the rejected one with ``rejected_prompt or prompt``; the pair is skipped
    if either side is empty.

Batches (:func:`collate`)
    Rows are prompt + target, RIGHT-padded, so every real token keeps the positions
    ``0..n-1`` it has when scored alone and no position ids are needed. A DPO batch of B
    pairs has 2B rows, the B chosen rows first, then the B rejected rows in the same
    order: chosen and rejected are scored by one batched forward. Only target tokens are
    scored: target token j of a row with a prompt of length p sits at position p + j and is
    predicted by the logits at position p + j - 1.

Log-probs (:func:`token_logps`)
    One forward of the transformer body (through PEFT, whose LoRA layers sit inside it),
    then the LM head, the log-softmax (a float32 ``logsumexp``) and the gather on exactly
    the hidden states that predict scored target tokens: never on prompt, pad or unscored
    (think-block under ``visible``) positions. The result is [rows, T_max] with 0 where the
    mask is 0. Works with any transformers causal LM that exposes ``get_decoder()`` and
    ``get_output_embeddings()`` (Qwen3 among them).

Objectives (:func:`loss`), with per-sequence sums l = sum of masked token log-probs
    * ``dpo``: mean over pairs of ``-logsigmoid(dpo_beta * ((l+ - l+ref) - (l- - l-ref)))``
      + ``kl_beta * KL``. Metrics: ``dpo_loss``, ``kl``, ``pref_acc`` (share of pairs with
      a positive margin), ``margin`` (mean of ``(l+ - l+ref) - (l- - l-ref)`` in nats,
      not multiplied by beta), ``loss``.
    * ``sft`` / ``rsft``: token-weighted mean NLL over the batch's scored target tokens +
      ``kl_beta * KL``. Metrics: ``nll``, ``kl`` (when reference log-probs are present;
      they are required when ``kl_beta > 0``), ``loss``.
    * KL: per scored target token the k3 estimator ``exp(d) - 1 - d`` with
      ``d = lref - l`` (non-negative, exactly 0 where policy == reference), averaged over
      all scored target tokens of the batch (chosen and rejected rows for dpo).
    The returned loss is the node objective value ``f_i`` reported to ADMM (the proximal
    term is added by the caller).

Reference (:func:`precompute_reference`)
    The reference log-probs never change during training (DESIGN.md section 4), so they are
    computed once per example under the caller's reference context (e.g. PEFT's
    ``model.disable_adapter`` for ``kl_ref frozen``), with ``torch.no_grad()`` and the model
    in eval mode, stored on the :class:`Encoded` records (float32, CPU) and copied into every
    batch by :func:`collate`. Records that already hold them are not recomputed.

Sampling (:class:`RoleBalancedSampler`)
    An infinite, deterministic, checkpointable stream of minibatch index lists; see the
    class for the balancing rule.

This module does not know the adapter class: it takes any ``torch.nn.Module`` causal LM and a
zero-argument context-manager factory for the reference.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

FIT_MODES = ("dpo", "sft", "rsft")
TARGET_SPANS = ("full", "visible")
THINK_CLOSE = "</think>"


# ----------------------------------------------------------------------------- configuration

@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    fit_mode: str = "dpo"            # dpo | sft | rsft
    dpo_beta: float = 0.1
    kl_beta: float = 0.1
    target_span: str = "full"        # full | visible (only tokens after </think> count)
    max_prompt_tokens: int = 8192    # prompt truncated from the LEFT
    max_target_tokens: int = 4096    # target truncated on the RIGHT

    def __post_init__(self) -> None:
        if self.fit_mode not in FIT_MODES:
            raise ValueError(f"fit_mode={self.fit_mode!r} is unknown: set fit_mode to one of "
                             f"{', '.join(FIT_MODES)}")
        if self.target_span not in TARGET_SPANS:
            raise ValueError(f"target_span={self.target_span!r} is unknown: set target_span "
                             f"to one of {', '.join(TARGET_SPANS)}")
        if not (isinstance(self.dpo_beta, (int, float)) and self.dpo_beta > 0):
            raise ValueError(f"dpo_beta={self.dpo_beta!r} must be a number > 0 "
                             f"(0.1 is the usual choice)")
        if not (isinstance(self.kl_beta, (int, float)) and self.kl_beta >= 0):
            raise ValueError(f"kl_beta={self.kl_beta!r} must be a number >= 0 "
                             f"(0 turns the KL term off)")
        for name in ("max_prompt_tokens", "max_target_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1: raise {name}")

    @property
    def paired(self) -> bool:
        return self.fit_mode == "dpo"


# ----------------------------------------------------------------------------- encoding

@dataclasses.dataclass(eq=False)
class Encoded:
    """One tokenised example. ``*_mask`` are 0/1 per target token; ``*ref_logps`` are the
    reference per-token log-probs (float32 CPU tensors of the target's length, 0 where the
    mask is 0), filled by :func:`precompute_reference`."""
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
        raise ValueError(f"target_span visible needs a tokenizer with a single {THINK_CLOSE!r} "
                         f"token; this one encodes it as {ids}: use target_span full")
    return int(tid)


def _span_mask(ids: Sequence[int], span: str, close_id: Optional[int]) -> List[int]:
    if span == "full":
        return [1] * len(ids)
    try:
        k = list(ids).index(close_id)
    except ValueError:
        return [1] * len(ids)
    return [0] * (k + 1) + [1] * (len(ids) - k - 1)


def encode(tokenizer, examples: Sequence[Any], cfg: ObjectiveConfig) -> EncodedSet:
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
            raise ValueError(f"fit_mode dpo needs a rejected message on every example; "
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
                           rejected_ids=rt, rejected_mask=rm))
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
            target_mask=mv(self.target_mask), ref_logps=mv(self.ref_logps))

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
        raise ValueError("collate needs at least one encoded example")
    paired = encoded_list[0].paired
    if any(e.paired != paired for e in encoded_list):
        raise ValueError("collate got a mix of dpo pairs and single targets: encode each "
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
            raise ValueError("an encoded row has an empty prompt: its first target token "
                             "has nothing to be predicted from (encode() skips these)")
        n, k = len(p), len(t)
        input_ids[r, :n + k] = torch.tensor(p + t, dtype=torch.long)
        attention[r, :n + k] = 1
        target_ids[r, :k] = torch.tensor(t, dtype=torch.long)
        target_pos[r, :k] = torch.arange(n, n + k)
        target_mask[r, :k] = torch.tensor(m, dtype=torch.float32)
        if with_ref:
            ref_logps[r, :k] = ref
    return Batch(input_ids=input_ids, attention_mask=attention, target_ids=target_ids,
                 target_pos=target_pos, target_mask=target_mask, ref_logps=ref_logps,
                 paired=paired, example_index=[e.example_index for e in encoded_list],
                 roles=[e.role for e in encoded_list])


def batches(encoded: Sequence[Encoded], batch_size: int, pad_id: int) -> Iterator[Batch]:
    """Consecutive batches of ``encoded`` in order (e.g. a dev set for :func:`nll`)."""
    for s in range(0, len(encoded), batch_size):
        yield collate(encoded[s:s + batch_size], pad_id)


# ----------------------------------------------------------------------------- log-probs

def _device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _decoder_and_head(model: torch.nn.Module):
    """The transformer body and the LM head of a causal LM (through a PEFT wrapper).

    LoRA layers live inside the body's modules, so calling the body directly keeps the
    adapter (and PEFT's ``disable_adapter()`` still turns it off)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    head = base.get_output_embeddings()
    if decoder is None or head is None:
        raise TypeError(f"{type(base).__name__} has no decoder/LM head: use a transformers "
                        "causal LM such as Qwen3ForCausalLM")
    return decoder, head


def token_logps(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Per-target-token log-probs [rows, T_max] (float32, 0 where the mask is 0) from ONE
    forward of ``model`` over all rows. Only the hidden states that predict scored tokens
    go through the LM head and the log-softmax (never prompt, padding or masked tokens)."""
    b = batch.to(_device(model))
    rows, cols = (b.target_mask > 0).nonzero(as_tuple=True)   # row-major: row, then position
    out = torch.zeros(b.target_mask.shape, dtype=torch.float32, device=b.target_mask.device)
    if rows.numel() == 0:
        return out
    pred = b.target_pos[rows, cols] - 1                        # the positions that predict them
    decoder, head = _decoder_and_head(model)
    hidden = decoder(input_ids=b.input_ids, attention_mask=b.attention_mask,
                     use_cache=False).last_hidden_state
    logits = head(hidden[rows, pred]).float()
    labels = b.target_ids[rows, cols]
    lp = -F.cross_entropy(logits, labels, reduction="none")
    return out.index_put((rows, cols), lp)


def precompute_reference(model: torch.nn.Module, encoded: Sequence[Encoded], *,
                         batch_size: int, ref_context: Callable[[], ContextManager],
                         pad_id: int = 0, force: bool = False) -> int:
    """Store the reference per-token log-probs on every record of ``encoded`` that has none
    (all of them with ``force``): under ``ref_context()``, ``torch.no_grad()`` and eval mode,
    in batches of ``batch_size`` records sorted by length (less padding; with right
    padding a row's values do not depend on its batch mates, up to float rounding).
    Returns the number of records computed; 0 forwards when every record already has its
    reference."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    todo = [e for e in encoded if force or not e.has_reference]
    if not todo:
        return 0
    todo.sort(key=lambda e: max(len(p) + len(t) for p, t, _, _ in e.rows()))
    was_training = model.training
    model.eval()
    try:
        with ref_context(), torch.no_grad():
            for s in range(0, len(todo), batch_size):
                chunk = todo[s:s + batch_size]
                for e in chunk:          # collate ignores partial references anyway
                    e.ref_logps = e.rejected_ref_logps = None
                b = collate(chunk, pad_id)
                lp = token_logps(model, b).cpu()
                for k, e in enumerate(chunk):
                    e.ref_logps = lp[k, :len(e.target_ids)].clone()
                    if e.paired:
                        e.rejected_ref_logps = lp[len(chunk) + k, :len(e.rejected_ids)].clone()
    finally:
        model.train(was_training)
    return len(todo)


# ----------------------------------------------------------------------------- objectives

def _k3(lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    d = ref - lp
    return ((torch.exp(d) - 1.0 - d) * mask).sum() / mask.sum().clamp_min(1.0)


def loss(model: torch.nn.Module, batch: Batch, cfg: ObjectiveConfig
         ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The node objective f_i on one batch (a scalar with grad) and float metrics."""
    if batch.paired != cfg.paired:
        raise ValueError(f"fit_mode {cfg.fit_mode} got a {'paired' if batch.paired else 'single'}"
                         f" batch: encode and collate the examples with the same fit_mode")
    need_ref = cfg.paired or cfg.kl_beta > 0
    if need_ref and batch.ref_logps is None:
        raise ValueError("the batch has no reference log-probs: call precompute_reference() "
                         "on the encoded examples before training"
                         + ("" if cfg.paired else " (or set kl_beta 0)"))
    b = batch.to(_device(model))
    lp = token_logps(model, b)
    mask = b.target_mask
    metrics: Dict[str, float] = {}
    kl = _k3(lp, b.ref_logps, mask) if b.ref_logps is not None else None
    if cfg.paired:
        n = b.n_examples
        logratio = ((lp - b.ref_logps) * mask).sum(-1)
        margin = logratio[:n] - logratio[n:]
        main = -F.logsigmoid(cfg.dpo_beta * margin).mean()
        metrics["dpo_loss"] = float(main.detach())
        metrics["pref_acc"] = float((margin.detach() > 0).float().mean())
        metrics["margin"] = float(margin.detach().mean())
    else:
        main = -(lp * mask).sum() / mask.sum().clamp_min(1.0)
        metrics["nll"] = float(main.detach())
    total = main + cfg.kl_beta * kl if (kl is not None and cfg.kl_beta > 0) else main
    if kl is not None:
        metrics["kl"] = float(kl.detach())
    metrics["loss"] = float(total.detach())
    return total, metrics


def nll(model: torch.nn.Module, batches: Iterable[Batch]) -> float:
    """Mean NLL per scored target token over all ``batches`` (chosen rows of dpo batches),
    without grad and in eval mode (e.g. the held-out dev NLL)."""
    tot, cnt = 0.0, 0.0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                b = batch.chosen()
                lp = token_logps(model, b)
                m = b.target_mask.to(lp.device)
                tot += float(-(lp * m).sum())
                cnt += float(m.sum())
    finally:
        model.train(was_training)
    if cnt == 0:
        raise ValueError("nll() got no scored target tokens")
    return tot / cnt


# ----------------------------------------------------------------------------- sampling

def _stream_seed(seed: int, key: str, epoch: int) -> int:
    h = hashlib.sha256(f"admm_dist.sampler|{seed}|{key}|{epoch}".encode("utf-8")).digest()
    return int.from_bytes(h[:8], "little")


class RoleBalancedSampler:
    """An infinite, deterministic stream of minibatches of indices into ``encoded``.

    Rule. With ``balance`` and K >= 2 roles (role names sorted), every batch of size b gives
    each role q = b // K slots, and the r = b % K remaining slots go to the next r roles of a
    cursor that rotates over the roles from batch to batch. So every batch holds q or q + 1
    examples of each role, and any K consecutive batches hold exactly K*q + r of each role,
    whatever the roles' sizes. Within a role, indices are drawn without replacement from a
    permutation of that role's examples; when it runs out, the next epoch of that role
    starts with a fresh permutation (small roles cycle faster; a role with fewer examples
    than its slots repeats within a batch). With one role or ``balance=False``, batches are
    consecutive slices of one permutation of all examples per epoch (an epoch boundary may
    fall inside a batch). Every permutation is a pure function of (seed, role, epoch).

    ``state_dict()`` is a small JSON-safe dict (per-stream epoch and position, the cursor);
    ``load_state_dict`` on a sampler built from the same examples, batch size, seed and
    ``balance`` continues the identical stream, and refuses a state from different ones.
    """

    VERSION = 1

    def __init__(self, encoded: Sequence[Any], batch_size: int, seed: int, balance: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if not encoded:
            raise ValueError("RoleBalancedSampler needs at least one example")
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        roles = [str(getattr(e, "role", e)) for e in encoded]
        groups: Dict[str, List[int]] = {}
        for i, r in enumerate(roles):
            groups.setdefault(r, []).append(i)
        self.roles = sorted(groups)
        self.balanced = bool(balance) and len(self.roles) > 1
        self.balance = bool(balance)
        self._groups = {r: groups[r] for r in self.roles} if self.balanced \
            else {"*": list(range(len(roles)))}
        self._fingerprint = hashlib.sha256("\n".join(roles).encode("utf-8")).hexdigest()[:16]
        self._state = {k: {"epoch": 0, "pos": 0} for k in self._groups}
        self._cursor = 0
        self._drawn = 0
        self._perm: Dict[str, Tuple[int, List[int]]] = {}

    def _permutation(self, key: str, epoch: int) -> List[int]:
        cached = self._perm.get(key)
        if cached is None or cached[0] != epoch:
            idx = list(self._groups[key])
            random.Random(_stream_seed(self.seed, key, epoch)).shuffle(idx)
            cached = self._perm[key] = (epoch, idx)
        return cached[1]

    def _draw(self, key: str, k: int) -> List[int]:
        st, out = self._state[key], []
        while len(out) < k:
            perm = self._permutation(key, st["epoch"])
            take = perm[st["pos"]:st["pos"] + (k - len(out))]
            out += take
            st["pos"] += len(take)
            if st["pos"] >= len(perm):
                st["epoch"] += 1
                st["pos"] = 0
        return out

    def next_batch(self) -> List[int]:
        b = self.batch_size
        if not self.balanced:
            out = self._draw("*", b)
        else:
            K = len(self.roles)
            q, r = divmod(b, K)
            extra = {(self._cursor + j) % K for j in range(r)}
            out = []
            for j, role in enumerate(self.roles):
                out += self._draw(role, q + (1 if j in extra else 0))
            self._cursor = (self._cursor + r) % K
        self._drawn += 1
        return out

    def __iter__(self) -> Iterator[List[int]]:
        while True:
            yield self.next_batch()

    @property
    def batches_drawn(self) -> int:
        return self._drawn

    def _identity(self) -> Dict[str, Any]:
        return {"seed": self.seed, "batch_size": self.batch_size, "balance": self.balance,
                "n_examples": sum(len(g) for g in self._groups.values()),
                "roles_fingerprint": self._fingerprint}

    def state_dict(self) -> Dict[str, Any]:
        return {"version": self.VERSION, **self._identity(),
                "streams": {k: dict(v) for k, v in self._state.items()},
                "cursor": self._cursor, "batches_drawn": self._drawn}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("version") != self.VERSION:
            raise ValueError(f"sampler state version {state.get('version')!r} is not "
                             f"{self.VERSION}: resume with the code that wrote it")
        diff = {k: (state.get(k), v) for k, v in self._identity().items() if state.get(k) != v}
        if diff:
            raise ValueError(f"sampler state was saved for other settings (saved, now): {diff}; "
                             f"resume with the same examples, batch_size, seed and role balance")
        streams = state.get("streams", {})
        if set(streams) != set(self._state):
            raise ValueError(f"sampler state streams {sorted(streams)} do not match "
                             f"{sorted(self._state)}: resume with the same examples")
        for k, v in streams.items():
            epoch, pos = int(v["epoch"]), int(v["pos"])
            if epoch < 0 or not 0 <= pos < len(self._groups[k]):
                raise ValueError(f"sampler state for {k!r} is out of range: {v}")
            self._state[k] = {"epoch": epoch, "pos": pos}
        self._cursor = int(state["cursor"]) % max(1, len(self.roles))
        self._drawn = int(state["batches_drawn"])
