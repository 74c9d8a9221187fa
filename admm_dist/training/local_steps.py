"""A node's x-step: ``local_steps`` Adam steps on f_i(x) + rho/2 ||x - centre||^2.

Each step draws a minibatch from the node's sampler. With ``micro_batches`` M = 1 it is one
forward and backward. With M > 1 the minibatch is M parts in a fixed order
(:func:`~admm_dist.engine.seat_group.parts`). Each part's gradient and loss are computed on their
own, every sum divided by the whole minibatch's examples and tokens
(:func:`~admm_dist.model.objectives.normalizers`). The ranks of the seat group share the parts,
and the parts' rows are summed in part order (:class:`~admm_dist.engine.seat_group.SeatGroup`),
so a step is the same bits whatever the number of ranks computing it. Then the proximal term,
the clipping and Adam's step run the same way on every rank of the group.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

import torch

from admm_dist.engine.seat_group import SeatGroup, parts
from admm_dist.model import batches as bt
from admm_dist.model import objectives as obj

if TYPE_CHECKING:
    from admm_dist.model.adapter import BOnlyLoRA
    from admm_dist.training.config import TrainConfig
    from admm_dist.training.state import NodeState


class LocalSteps:
    """The x-steps of this rank's nodes, on one model and adapter."""

    def __init__(self, cfg: "TrainConfig", model: Any, adapter: "BOnlyLoRA", ocfg: obj.ObjectiveConfig,
                 pad_id: int, seat: SeatGroup) -> None:
        self.cfg, self.model, self.adapter, self.ocfg, self.pad_id, self.seat = (
            cfg, model, adapter, ocfg, pad_id, seat)
        if cfg.micro_batches > 1:
            seat.check(cfg.micro_batches)

    def run(self, st: "NodeState", x: torch.Tensor, centre: Optional[torch.Tensor], rho: float) -> float:
        """x := the x-step's result from x, centre = z_i - u_i; the mean loss of its steps."""
        cfg, ad = self.cfg, self.adapter
        if st.sampler is None:
            # f_i = 0: the x-step's exact minimizer of rho/2 ||x - (z_i - u_i)||^2
            if centre is not None:
                x.copy_(centre)
            return 0.0
        ad.load_vector(x)
        self.model.train()
        total = 0.0
        for _ in range(cfg.local_steps):
            value = self.gradient(st, st.sampler.next_batch())
            total += value
            if not math.isfinite(value):
                break  # every rank stops at this round's telemetry, with the node named
            if centre is not None and rho > 0:
                ad.flat_grad.add_(ad.flat - centre, alpha=rho)
            torch.nn.utils.clip_grad_norm_([ad.param], cfg.grad_clip)
            st.optimizer.step()
        x.copy_(ad.vector())
        return total / cfg.local_steps

    def gradient(self, st: "NodeState", idx: List[int]) -> float:
        """One step's loss on the examples ``idx``; its gradient is left in the adapter's flat grad."""
        ad = self.adapter
        if self.cfg.micro_batches == 1:
            ad.zero_grad()
            loss, _ = obj.loss(self.model, bt.collate([st.encoded[i] for i in idx], self.pad_id), self.ocfg)
            loss.backward()
            return loss.item()
        batches = [bt.collate([st.encoded[i] for i in part], self.pad_id)
                   for part in parts(idx, self.cfg.micro_batches)]
        norm, rows = obj.normalizers(batches), []
        for m in self.seat.my_parts(len(batches)):
            ad.zero_grad()
            loss, _ = obj.loss(self.model, batches[m], self.ocfg, norm)
            loss.backward()
            rows.append(torch.cat([ad.flat_grad, loss.detach().reshape(1).to(ad.flat_grad)]))
        summed = self.seat.ordered_sum(torch.stack(rows))
        ad.flat_grad.copy_(summed[:-1])
        return float(summed[-1])


def sampling_digest(enc: Sequence[bt.Encoded]) -> str:
    """A sha256 (16 hex digits) of the sampling policy's log-probs of ``enc``, record by record: a
    checkpoint keeps it, and a resume that makes the collection again checks it."""
    h = hashlib.sha256()
    for e in enc:
        h.update(e.sample_logps.numpy().tobytes())
    return h.hexdigest()[:16]


def checkpoint_activations(model: Any, cfg: "TrainConfig", device_type: str) -> None:
    """Gradient checkpointing trades compute for activation memory: on by default on GPU
    (``no_grad_checkpointing`` turns it off); a CPU run has the memory and would only pay the
    recomputation (about +50% per step)."""
    if not cfg.no_grad_checkpointing and device_type == "cuda":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()


def reference_logps(cfg: "TrainConfig", adapter: "BOnlyLoRA", seat: SeatGroup, enc: Sequence[bt.Encoded],
                    vec: Optional[torch.Tensor], pad_id: int, show: bool = False,
                    sampling: bool = False) -> None:
    """Reference log-probs of ``enc`` (``sampling``: the sampling policy's), once per example: under
    the adapter state ``vec`` (the policy that collected them), or adapters off (None); a seat's k
    ranks compute a batch each in turn and share them."""
    if vec is not None:
        adapter.load_vector(vec)
    model = adapter.model
    ctx = (lambda: contextlib.nullcontext(model)) if vec is not None else adapter.disabled
    obj.precompute_reference(model, enc, batch_size=cfg.forward_rows, ref_context=ctx, pad_id=pad_id,
                             show=show, part=(seat.index, seat.k), gather=seat.gather, sampling=sampling,
                             desc="sampling log-probs" if sampling else "reference log-probs")
