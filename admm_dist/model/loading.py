"""Loading a backbone: a local model folder or a hub id, checked before anything loads."""
from __future__ import annotations

import os

from admm_dist.core.errors import UserError, one_line
from admm_dist.core.io import check_model_files
from admm_dist.core.libraries import quiet_libraries


def check_model_src(src: str, what: str = "--model_name") -> bool:
    """Refuse a model path that cannot be a model, before anything loads; True if local. A local
    folder's entries are checked first (:func:`check_model_files`)."""
    local = os.path.isdir(src)
    if not local and (src.startswith((".", "/", "~")) or src.count("/") > 1 or os.path.exists(src)):
        raise UserError(f"{what} {src}: no such model folder (give a folder with config.json or a hub id)")
    if local:
        check_model_files(src, f"{what} {src}:")
    if local and not os.path.isfile(os.path.join(src, "config.json")):
        raise UserError(f"{what} {src}: the folder holds no config.json, so it is not a model folder")
    return local


DTYPES = ("auto", "float32", "bfloat16")   # a backbone's dtype setting (backbone_dtype)


def backbone_dtype(device, dtype: str = "auto"):
    """The backbone's torch dtype: ``auto`` is bfloat16 on CUDA and float32 on CPU; ``float32``
    and ``bfloat16`` are taken as given (on a CPU with AVX512-BF16 a bf16 matrix product runs
    about twice as fast; a LoRA adapter's own path stays in float32)."""
    import torch

    if dtype not in DTYPES:
        raise UserError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_model(src: str, device, *, what: str = "--model_name", shard_over=None, dtype: str = "auto"):
    """(model, tokenizer) from a local folder or a hub id, in eval mode on ``device`` in
    :func:`backbone_dtype`; a model that cannot be loaded is one UserError. With
    ``shard_over`` (a 1-D device mesh: a seat group) each of its ranks loads only its shard of every weight
    (:func:`admm_dist.model.sharding.load_sharded`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_libraries()
    local = check_model_src(src, what)
    dtype = backbone_dtype(device, dtype)
    try:
        tok = AutoTokenizer.from_pretrained(src, local_files_only=local)
        if shard_over is not None:
            from admm_dist.model.sharding import load_sharded

            model = load_sharded(src, device, shard_over, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, local_files_only=local)
    except UserError:
        raise
    except Exception as exc:  # transformers raises OSError, ValueError, hub errors...
        raise UserError(f"{what} {src}: cannot load it ({type(exc).__name__}: {one_line(exc)[:160]}): "
                        f"give a local model folder or a reachable hub id") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return (model if shard_over is not None else model.to(device)).eval(), tok
