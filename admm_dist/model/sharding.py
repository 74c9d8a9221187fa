"""The frozen backbone sharded over a seat group with FSDP2 (``shard_backbone=true``).

Each decoder layer, then the rest of the decoder and an untied output head, becomes one
``fully_shard`` group over the seat group's ranks (a 1-D device mesh from its process group).
A rank then holds 1/k of each frozen weight, and FSDP2 all-gathers a layer's weights just
before the layer runs and frees them after. The gathered weights are the original values, so
every forward and backward computes the same bits as the unsharded model (on CPU; on GPU
where the kernels are deterministic).

The LoRA weights are left out (``ignored_params``). The B vector the engine works on stays
whole on every rank of the group: each rank's B weights are views into its one flat vector
(:class:`~admm_dist.model.adapter.BOnlyLoRA`), and every rank of a seat runs the same Adam
step on the same summed gradient (:mod:`admm_dist.engine.seat_group`). The random basis A
stays whole too: it is small, and its hash checks every rank's basis.

Every rank of the group must then run the same number of forwards at the same time. The
trainer's x-steps (M / k parts each), reference log-probs and held-out NLL already do.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from admm_dist.model.vectors import backbone_identity

if TYPE_CHECKING:
    from admm_dist.model.adapter import BOnlyLoRA


def shard_backbone(adapter: "BOnlyLoRA", group: dist.ProcessGroup, device_type: str) -> None:
    """Shard ``adapter``'s frozen backbone over ``group`` (the ranks of one seat)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    backbone_identity(adapter)   # what saved vectors record of the backbone: read while it is whole
    mesh = DeviceMesh.from_group(group, device_type=device_type)
    keep = {p for name, p in adapter.model.named_parameters() if "lora_" in name} | {adapter.param}
    base = adapter.model.get_base_model()
    decoder = base.get_decoder()
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, ignored_params=keep & set(layer.parameters()))
    fully_shard(decoder, mesh=mesh, ignored_params=keep & set(decoder.parameters()))
    head = base.get_output_embeddings()
    if head is not None and head.weight is not decoder.get_input_embeddings().weight:
        fully_shard(head, mesh=mesh, ignored_params=keep & set(head.parameters()))


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds: a sharded weight's local shard, the rest whole."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total
