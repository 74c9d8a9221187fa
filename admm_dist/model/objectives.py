"""Node objectives f_i (docs/design.md section 3): DPO, SFT, rejection-sampled SFT and GRPO, with a KL term.

Pipeline, for one node's examples::

    enc = encode(tokenizer, examples, cfg)               # token ids + per-token masks
    precompute_reference(model, enc, batch_size=8,       # reference log-probs, ONCE
                         ref_context=model.disable_adapter)
    sampler = RoleBalancedSampler(enc, batch_size, seed)
    batch = collate([enc[i] for i in sampler.next_batch()], tokenizer.pad_token_id)
    f, metrics = loss(model, batch, cfg)                  # f_i, the value ADMM reports

with :func:`~admm_dist.model.batches.encode` and :func:`~admm_dist.model.batches.collate`
from :mod:`admm_dist.model.batches` (tokenisation, masks, padding) and
:class:`~admm_dist.data.sampler.RoleBalancedSampler` from :mod:`admm_dist.data.sampler`.
This module owns :class:`ObjectiveConfig`, :func:`token_logps`, :func:`precompute_reference`,
:func:`loss`, :func:`nll` and :func:`nll_sum`.

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
    * ``grpo``: :func:`clipped_surrogate`, GRPO's per-token objective (the clipped importance
      ratio against the policy that sampled the messages, times each message's group advantage,
      plus ``kl_beta`` times the k3 KL weighted by that ratio), summed over the batch's scored
      tokens and divided by their number: TRL's ``GRPOTrainer`` loss with ``loss_type="dapo"``
      in value and gradient (tests/model/test_grpo_trl.py). Metrics: ``clip_frac``, ``kl``
      (when ``kl_beta`` > 0), ``loss``. The sampling policy's log-probs are stored on the records
      beside the reference's (:func:`precompute_reference` with ``sampling=True``).

Reference (:func:`precompute_reference`)
    The reference log-probs never change during training (docs/design.md section 3), so they are
    computed once per example under the caller's reference context (e.g. PEFT's
    ``model.disable_adapter`` for ``kl_ref frozen``), with ``torch.no_grad()`` and the model
    in eval mode, stored on the :class:`~admm_dist.model.batches.Encoded` records (float32,
    CPU) and copied into every batch by :func:`~admm_dist.model.batches.collate`. Records
    that already hold them are not recomputed.

This module does not know the adapter class: it takes any ``torch.nn.Module`` causal LM and a
zero-argument context-manager factory for the reference.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, ContextManager, Dict, Iterable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from admm_dist.core import progress
from admm_dist.core.config_file import check_bounds, key
from admm_dist.core.errors import UserError
from admm_dist.model.batches import Batch, Encoded, collate
from admm_dist.model.batches import batches as batch_iter

FIT_MODES = ("dpo", "sft", "rsft", "grpo")
TARGET_SPANS = ("full", "visible")
# Scored tokens whose logits (float32, [n, vocab]) are made at once: a batch with more goes through
# the LM head in chunks of this many, so that its logits, their log-softmax and, under autograd,
# their gradient are held a chunk at a time (at Qwen3's vocabulary of 151,936: 0.6 GB a chunk
# instead of 2.4 GB per 1,024 tokens of the batch, times three). A batch of at most this many is
# one chunk, as before. A head that FSDP2 shards (shard_backbone) is called once: each call would
# gather it again, and a chunk made again in the backward gathers it beside the backward's own
# gather (the rehearsal of Qwen3-8B, 8 micro-batches over 8 ranks sharded: 18.8 GiB a rank instead
# of 15.4; at 2 micro-batches chunks would save, 66.1 instead of 92.3: a sharded head that gathers
# once for all its chunks is still to be done).
HEAD_CHUNK = 1024
KL_REFS = ("frozen", "collect")   # kl_ref: the KL reference is the bare backbone or the warm start


# ----------------------------------------------------------------------------- configuration

@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    fit_mode: str = key("dpo",
                        "each node's objective: dpo (preference pairs, successful over failed message), "
                        "sft (every collected message), rsft (messages of successful rollouts only), "
                        "grpo (every collected message, weighted by its group advantage under a clipped "
                        "ratio to the policy that sampled it: needs recollect_every=1)",
                        choices=FIT_MODES)
    dpo_beta: float = key(0.1, "DPO temperature beta", above=0)
    kl_beta: float = key(0.1, "weight of the per-token KL to the reference policy (0: no KL term)",
                         at_least=0)
    target_span: str = key("full", "tokens fitted: full (the whole message, <think> block included) or "
                           "visible (only the text after the last </think>)", choices=TARGET_SPANS)
    max_prompt_tokens: int = key(8192, "a longer prompt is truncated from the left", at_least=1)
    max_target_tokens: int = key(4096, "a longer target is truncated on the right", at_least=1)
    clip_eps: float = key(0.2, "grpo: the ratio to the sampling policy is clipped below at 1 - clip_eps",
                          above=0, below=1)
    clip_eps_high: float = key(0.2, "grpo: ... and above at 1 + clip_eps_high (DAPO's clip-higher raises it, "
                               "e.g. 0.28)", above=0)

    def __post_init__(self) -> None:
        if self.fit_mode not in FIT_MODES:
            raise UserError(f"fit_mode={self.fit_mode!r} is unknown: set fit_mode to one of "
                            f"{', '.join(FIT_MODES)}")
        if self.target_span not in TARGET_SPANS:
            raise UserError(f"target_span={self.target_span!r} is unknown: set target_span "
                            f"to one of {', '.join(TARGET_SPANS)}")
        check_bounds(self)

    @property
    def paired(self) -> bool:
        return self.fit_mode == "dpo"

    @property
    def needs_sampling(self) -> bool:
        """GRPO's ratio is taken against the log-probs of the policy that sampled the messages."""
        return self.fit_mode == "grpo"

    @property
    def needs_reference(self) -> bool:
        """DPO's margin and the KL term are taken against reference log-probs."""
        return self.paired or self.kl_beta > 0


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
    scored, labels = hidden[rows, pred], b.target_ids[rows, cols]
    if len(labels) <= HEAD_CHUNK or hasattr(head, "unshard"):   # an FSDP2-sharded head: once (below)
        lp = _head_logps(head, scored, labels)
    else:   # a chunk's logits at a time; under autograd each chunk's are made again for its backward
        keep = torch.is_grad_enabled() and scored.requires_grad
        lp = torch.cat([checkpoint(_head_logps, head, scored[i:i + HEAD_CHUNK], labels[i:i + HEAD_CHUNK],
                                   use_reentrant=False) if keep else
                        _head_logps(head, scored[i:i + HEAD_CHUNK], labels[i:i + HEAD_CHUNK])
                        for i in range(0, len(labels), HEAD_CHUNK)])
    return out.index_put((rows, cols), lp)


def _head_logps(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The log-probs of ``labels`` from the LM head on ``hidden`` [n, d], in float32."""
    return -F.cross_entropy(head(hidden).float(), labels, reduction="none")


def precompute_reference(model: torch.nn.Module, encoded: Sequence[Encoded], *,
                         batch_size: int, ref_context: Callable[[], ContextManager],
                         pad_id: int = 0, force: bool = False, show: bool = False,
                         desc: str = "reference log-probs", part: Tuple[int, int] = (0, 1),
                         gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                         sampling: bool = False) -> int:
    """Store the reference per-token log-probs on every record of ``encoded`` that has none
    (all of them with ``force``; with ``sampling``, the sampling policy's, ``sample_logps``, on
    records of single targets): under ``ref_context()``, ``torch.no_grad()`` and eval mode,
    in batches of ``batch_size`` records sorted by length (less padding; with right
    padding a row's values do not depend on its batch mates, up to float rounding).
    Returns the number of records computed; 0 forwards when every record already has its
    reference. ``show``: a progress bar (:mod:`admm_dist.core.progress`) over the records.

    ``part=(j, k)`` with ``gather``: the k ranks of a seat group share the work. Batch b runs on
    rank b mod k, the same batches as with k = 1, so the same bits; every rank runs the same
    number of forwards (the last batch again where it has one fewer: a sharded backbone's
    forwards are collectives). ``gather`` (a [n] vector -> every rank's, [k, n]) then hands each
    rank every record's values."""
    if batch_size < 1:
        raise UserError(f"batch_size={batch_size} must be >= 1")
    fields = _SAMPLING if sampling else _REFERENCE
    if sampling and any(e.paired for e in encoded):
        raise UserError("sampling log-probs are for single targets (fit_mode grpo), not preference pairs")
    todo = [e for e in encoded if force or getattr(e, fields[0]) is None
            or (e.paired and getattr(e, fields[1]) is None)]
    if not todo:
        return 0
    todo.sort(key=lambda e: max(len(p) + len(t) for p, t, _, _ in e.rows()))
    was_training = model.training
    model.eval()
    try:
        with ref_context(), torch.no_grad(), progress.bar(total=len(todo), desc=desc, unit="ex",
                                                          show=show, leave=False) as shown:
            batches = [todo[s:s + batch_size] for s in range(0, len(todo), batch_size)]
            j, k = part
            for b in range(j, -(-len(batches) // k) * k, k):
                chunk = batches[min(b, len(batches) - 1)]
                for e in chunk:          # collate ignores partial references anyway
                    for name in filter(None, fields):
                        setattr(e, name, None)
                lp = token_logps(model, collate(chunk, pad_id)).cpu()
                for i, e in enumerate(chunk):
                    setattr(e, fields[0], lp[i, :len(e.target_ids)].clone())
                    if e.paired:
                        setattr(e, fields[1], lp[len(chunk) + i, :len(e.rejected_ids)].clone())
                shown.update(len(chunk))
            if k > 1:
                _share(batches, j, k, gather, fields)
    finally:
        model.train(was_training)
    return len(todo)


_REFERENCE = ("ref_logps", "rejected_ref_logps")   # the records' fields precompute_reference fills
_SAMPLING = ("sample_logps", None)   # ... with sampling=True (single targets only)


def _share(batches: Sequence[Sequence[Encoded]], j: int, k: int,
           gather: Callable[[torch.Tensor], torch.Tensor], fields: Tuple[str, Optional[str]]) -> None:
    """Every record's values in ``fields`` from the rank that computed them (batch b's: rank b mod k)."""
    own, rejected = fields
    mine = torch.zeros(sum(len(e.target_ids) + (len(e.rejected_ids) if e.paired else 0)
                           for chunk in batches for e in chunk), dtype=torch.float32)
    at = 0
    for b, chunk in enumerate(batches):
        for e in chunk:
            n, m = len(e.target_ids), (len(e.rejected_ids) if e.paired else 0)
            if b % k == j:
                mine[at:at + n] = getattr(e, own)
                if m:
                    mine[at + n:at + n + m] = getattr(e, rejected)
            at += n + m
    every = gather(mine)
    at = 0
    for b, chunk in enumerate(batches):
        for e in chunk:
            n, m = len(e.target_ids), (len(e.rejected_ids) if e.paired else 0)
            setattr(e, own, every[b % k, at:at + n].clone())
            if rejected is not None:
                setattr(e, rejected, every[b % k, at + n:at + n + m].clone() if m else None)
            at += n + m


# ----------------------------------------------------------------------------- objectives

def _k3(lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, tokens: Optional[float]) -> torch.Tensor:
    d = ref - lp
    return ((torch.exp(d) - 1.0 - d) * mask).sum() / (mask.sum().clamp_min(1.0) if tokens is None else tokens)


def clipped_surrogate(lp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      *, clip_low: float, clip_high: float, ref: Optional[torch.Tensor] = None,
                      kl_beta: float = 0.0, tokens: Optional[float] = None
                      ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """GRPO's per-token objective (PPO's clipped ratio against the sampling policy) on [rows, T]
    log-probs: per scored token ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` with
    ``r = exp(lp - old)`` (``old``: the sampling policy's log-probs, recorded when the messages
    were sampled) and ``A`` the row's advantage [rows], plus ``kl_beta`` times the k3 KL to
    ``ref`` weighted by ``r`` (the tokens were drawn from the sampling policy: TRL's
    ``use_bias_correction_kl``, its default), summed over the scored tokens and divided by
    their number, or by ``tokens`` (the whole minibatch's, for a micro-batch). This is TRL's
    ``GRPOTrainer`` with ``loss_type="dapo"`` (its default: one token-mean over the generation
    batch), ``epsilon=clip_low``, ``epsilon_high=clip_high``, ``beta=kl_beta`` and token-level
    importance sampling. Metrics: ``clip_frac`` (the share of scored tokens whose ratio is
    clipped where the clip binds) and ``kl``."""
    ratio = torch.exp(lp - old)
    adv = advantages.to(lp.dtype).unsqueeze(-1)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    denom = mask.sum().clamp_min(1.0) if tokens is None else tokens
    metrics = {}
    if ref is not None and kl_beta > 0:
        d = ref - lp
        # k3 at the current policy, on tokens the sampling policy drew
        kl = ratio * (torch.exp(d) - 1.0 - d)
        per_token = per_token + kl_beta * kl
        metrics["kl"] = float((kl.detach() * mask).sum() / denom)
    binds = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
    metrics["clip_frac"] = float((binds.float() * mask).sum() / mask.sum().clamp_min(1.0))
    return (per_token * mask).sum() / denom, metrics


def normalizers(parts: Sequence[Batch]) -> Tuple[float, float]:
    """(examples, target tokens) of a minibatch collated as ``parts`` (micro-batches): what
    :func:`loss` divides each part's sums by, so that the parts' losses add up to the minibatch's."""
    return (float(sum(b.n_examples for b in parts)),
            max(1.0, float(sum(float(b.target_mask.sum()) for b in parts))))


def loss(model: torch.nn.Module, batch: Batch, cfg: ObjectiveConfig,
         norm: Optional[Tuple[float, float]] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The node objective f_i on one batch (a scalar with grad) and float metrics. With
    ``norm`` (:func:`normalizers`), ``batch`` is one micro-batch of a minibatch: its sums are
    divided by the whole minibatch's examples and tokens, so the parts' losses add up."""
    if batch.paired != cfg.paired:
        raise UserError(f"fit_mode {cfg.fit_mode} got a {'paired' if batch.paired else 'single'}"
                        f" batch: encode and collate the examples with the same fit_mode")
    if cfg.needs_reference and batch.ref_logps is None:
        raise UserError("the batch has no reference log-probs: call precompute_reference() "
                        "on the encoded examples before training"
                        + ("" if cfg.paired else " (or set kl_beta 0)"))
    if cfg.needs_sampling and (batch.sample_logps is None or batch.advantages is None):
        raise UserError("a grpo batch needs its messages' advantages and the sampling policy's log-probs: "
                        "encode the examples with fit_mode grpo and call precompute_reference(..., "
                        "sampling=True) under the state that sampled them")
    b = batch.to(_device(model))
    lp = token_logps(model, b)
    mask = b.target_mask
    metrics: Dict[str, float] = {}
    examples, tokens = norm if norm is not None else (None, None)
    if cfg.needs_sampling:   # the KL (ratio-weighted, as TRL's) is inside the surrogate
        total, metrics = clipped_surrogate(lp, b.sample_logps, b.advantages, mask, clip_low=cfg.clip_eps,
                                           clip_high=cfg.clip_eps_high, ref=b.ref_logps, kl_beta=cfg.kl_beta,
                                           tokens=tokens)
        metrics["loss"] = float(total.detach())
        return total, metrics
    kl = _k3(lp, b.ref_logps, mask, tokens) if b.ref_logps is not None else None
    if cfg.paired:
        n = b.n_examples
        logratio = ((lp - b.ref_logps) * mask).sum(-1)
        margin = logratio[:n] - logratio[n:]
        pair = F.logsigmoid(cfg.dpo_beta * margin)
        main = -pair.mean() if examples is None else -pair.sum() / examples
        metrics["dpo_loss"] = float(main.detach())
        metrics["pref_acc"] = float((margin.detach() > 0).float().mean())
        metrics["margin"] = float(margin.detach().mean())
    else:
        main = -(lp * mask).sum() / (mask.sum().clamp_min(1.0) if tokens is None else tokens)
        metrics["nll"] = float(main.detach())
    total = main + cfg.kl_beta * kl if (kl is not None and cfg.kl_beta > 0) else main
    if kl is not None:
        metrics["kl"] = float(kl.detach())
    metrics["loss"] = float(total.detach())
    return total, metrics


def nll_totals(model: torch.nn.Module, batches: Iterable[Batch]) -> Tuple[float, float]:
    """(sum of NLL, number of tokens) over the scored target tokens of ``batches`` (chosen
    rows of dpo batches), without grad and in eval mode; the model's mode is restored."""
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
    return tot, cnt


def nll(model: torch.nn.Module, batches: Iterable[Batch]) -> float:
    """Mean NLL per scored target token over all ``batches`` (e.g. the held-out dev NLL)."""
    tot, cnt = nll_totals(model, batches)
    if cnt == 0:
        raise UserError("nll() got no scored target tokens")
    return tot / cnt


def nll_sum(model: torch.nn.Module, encoded: Sequence[Encoded], batch_size: int,
            pad_id: int) -> Tuple[float, float]:
    """:func:`nll_totals` of ``encoded`` in consecutive batches of ``batch_size`` records;
    ``(0.0, 0.0)`` without a forward when ``encoded`` is empty. Summed over the nodes' shards,
    the ratio is the mean NLL of their union (the held-out dev NLL)."""
    if not encoded:
        return 0.0, 0.0
    return nll_totals(model, batch_iter(encoded, batch_size, pad_id))
