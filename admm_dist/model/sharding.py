"""The frozen backbone sharded over a seat group with FSDP2 (``shard_backbone=true``).

Loading: no rank ever holds the whole backbone. The model is built on the meta device
(accelerate's ``init_empty_weights``: parameters take no memory, buffers such as the rotary
frequencies are real). Then, over the seat group's ranks (a 1-D device mesh from its process
group), each decoder layer becomes one ``fully_shard`` group; the decoder's embedding and final
norm with the output head (tied or not) one more, a group of two modules, because the
objectives run the decoder and then the head on the scored positions only
(:func:`admm_dist.model.objectives.token_logps`); and the causal LM the root, run once on one
token so that FSDP2 takes it as the root. Only then is memory allocated: each rank's shard of
each weight, rows ``[r * ceil(n / k), ...)`` of dim 0, read from the model folder's safetensors
files with plain reads (:class:`WeightFiles`). Host RAM for the weights is then about 1/k of
the backbone per rank (measured by ``python -m admm_dist.bench.placement``).

Running: FSDP2 all-gathers a layer's weights just before the layer runs and frees them
after. The gathered weights are the file's values, so every forward and backward computes the
same bits as the unsharded model (on CPU; on GPU where the kernels are deterministic).

The LoRA layers are added afterwards, outside FSDP's groups: the B vector the engine works on
stays whole on every rank of the group (each rank's B weights are views into its one flat
vector, :class:`~admm_dist.model.adapter.BOnlyLoRA`), and every rank of a seat runs the same
Adam step on the same summed gradient (:mod:`admm_dist.engine.seat_group`). The random basis
A stays whole too: it is small, and its hash checks every rank's basis. Whatever reads a whole
frozen weight (the backbone's digest, ||W||^2 for ``delta_w_rel``) gathers it, one tensor at a
time, while the adapter is built, on every rank of the group in the same order.

Every rank of the group must then run the same number of forwards at the same time. The
trainer's x-steps (M / k parts each), reference log-probs and held-out NLL do.
"""
from __future__ import annotations

import ctypes
import glob
import json
import math
import os
import struct
from typing import Dict, Tuple

import torch
import torch.distributed as dist

from admm_dist.core.errors import UserError


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or the whole tensor a sharded parameter is a shard of (a collective over its
    group: every rank of the group must call it for the same tensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


MAX_HEADER = 100 * 2 ** 20   # bytes of a safetensors header, at most (the format's own bound)


class WeightFiles:
    """The tensors of a model folder's safetensors files, read a range of rows at a time with
    plain reads (no memory map: what a rank reads is what it holds). Each file's header (its
    first 8 bytes give the length of a JSON table of name -> dtype, shape, byte offsets) is
    read once."""

    def __init__(self, folder: str) -> None:
        self.tensors: Dict[str, Tuple[str, int, torch.dtype, Tuple[int, ...]]] = {}
        for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            with open(path, "rb") as fh:
                head = fh.read(8)
                size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                try:
                    header = json.loads(fh.read(size)) if 0 < size <= MAX_HEADER else None
                except ValueError:
                    header = None
            if not isinstance(header, dict):
                raise UserError(f"shard_backbone: {path} is not a safetensors file (its header cannot be read): "
                                f"download it again")
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                if t["dtype"] not in _DTYPES:
                    raise UserError(f"shard_backbone: {path} holds {name} as {t['dtype']}, which this loader does "
                                    f"not read: drop shard_backbone=true")
                self.tensors[name] = (path, 8 + size + t["data_offsets"][0], _DTYPES[t["dtype"]], tuple(t["shape"]))

    def read_rows(self, name: str, start: int, out: torch.Tensor) -> None:
        """Rows ``start .. start + len(out)`` of tensor ``name`` (dim 0; a 0-d tensor whole) into
        ``out``: straight into it when it is a contiguous CPU tensor of the file's dtype, else
        through a buffer of one shard of one tensor (cast, or copied to the device)."""
        path, offset, dtype, shape = self.tensors[name]
        row = dtype.itemsize * math.prod(shape[1:]) if shape else dtype.itemsize
        direct = out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu"
        buf = out if direct else torch.empty(out.shape, dtype=dtype)
        view = memoryview(buf.view(torch.uint8).numpy()).cast("B") if buf.numel() else memoryview(b"")
        got = 0
        with open(path, "rb", buffering=0) as fh:
            fh.seek(offset + start * row)
            while got < len(view):      # one read returns at most about 2 GiB
                n = fh.readinto(view[got:])
                if not n:
                    break
                got += n
        if got != len(view):
            raise UserError(f"shard_backbone: {path} ends inside {name}: the file is cut short; download it again")
        if not direct:
            out.copy_(buf)


def _local_folder(src: str) -> str:
    """A hub id's snapshot (config, tokenizer and safetensors files only), or ``src`` itself."""
    if os.path.isdir(src):
        return src
    from huggingface_hub import snapshot_download

    return snapshot_download(src, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"])


def load_sharded(src: str, device: torch.device, group: dist.ProcessGroup, dtype: torch.dtype):
    """The causal LM of ``src`` with its weights sharded over ``group`` (the ranks of one seat),
    each rank reading only its own rows from the safetensors files."""
    from accelerate import init_empty_weights
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = _local_folder(src)
    files = WeightFiles(folder)
    if not files.tensors:
        raise UserError(f"shard_backbone: {src} has no safetensors weights to read shard by shard: convert the "
                        f"model to safetensors (save_pretrained) or drop shard_backbone=true")
    _return_freed_memory()
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()                    # a tied head is the embedding's parameter, held once
    mesh = DeviceMesh.from_group(group, device_type=device.type)
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([decoder, head] if head is not None else decoder, mesh=mesh)
    fully_shard(model, mesh=mesh)          # the root: no parameters of its own
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)          # allocates each rank's shards only
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
        for name, p in model.named_parameters():
            if name not in files.tensors:
                raise UserError(f"shard_backbone: {folder} has no tensor {name}: load this model unsharded "
                                f"(drop shard_backbone=true)")
            if files.tensors[name][3] != tuple(p.shape):
                raise UserError(f"shard_backbone: {name} is {list(files.tensors[name][3])} in {folder} but "
                                f"{list(p.shape)} in its config.json: the folder's files do not match")
            local = p.to_local() if hasattr(p, "to_local") else p
            files.read_rows(name, _first_row(p, group), local)
    with torch.no_grad():   # FSDP2 takes its root to be the first module run: run the model once
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    return model.eval()


def _first_row(p: torch.Tensor, group: dist.ProcessGroup) -> int:
    """The first row of dim 0 that this rank holds of ``p`` (FSDP2 shards dim 0 as torch.chunk)."""
    if not hasattr(p, "to_local") or p.dim() == 0:
        return 0
    chunk = -(-p.shape[0] // dist.get_world_size(group))
    return min(dist.get_rank(group) * chunk, p.shape[0])


def _return_freed_memory() -> None:
    """Have glibc hand freed blocks of 1 MiB and more straight back to the system. FSDP2 gathers
    a layer's weights and frees them at every forward; glibc's mmap threshold otherwise rises
    to the size of such a block, keeps the freed gathers on its heap, and the resident set grows
    to hold a whole backbone's worth of them (measured: SmolLM2 at k = 4, 536 MiB after loading,
    914-1469 MiB after one forward; 558-567 MiB with this). Nothing happens without glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 20)   # M_MMAP_THRESHOLD: fixed, no longer dynamic
    except (OSError, AttributeError):
        pass


def held_bytes(model: torch.nn.Module) -> Tuple[int, int]:
    """(backbone, adapter): bytes of the parameters this rank holds, the frozen backbone's (a
    sharded weight's local shard) and the LoRA weights' (whole on every rank)."""
    held = [0, 0]
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        held["lora_" in name] += local.numel() * local.element_size()
    return held[0], held[1]
