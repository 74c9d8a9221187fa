"""B-vector files and cross-rank basis checks: the adapter's state on disk and on the wire.

Files hold data, never code: :func:`save_vector` / :func:`load_vector` write and read a
safetensors file with the flat vector under key ``"b"`` and JSON metadata (the adapter's
identity: config, basis hash, layout, numel, the backbone it was trained on, plus the caller's
fields), so loading a vector into a differently-built adapter is one clear :class:`AdapterError`;
``load_vector(..., backbone=True)`` also refuses a backbone of the same shape with other weights
(:func:`backbone_identity`, :func:`check_backbone`).

Every rank draws the same frozen A basis from ``lora_basis_seed``
(:class:`~admm_dist.model.adapter.BOnlyLoRA`); :func:`check_same_basis` checks that the ranks'
:meth:`~admm_dist.model.adapter.BOnlyLoRA.basis_hash` values agree, and
:func:`hash_to_int64_row` packs a hash into a ``[1, 4]`` int64 row that a control table
(:meth:`admm_dist.engine.control.Control.table`) can carry (:func:`int64_row_to_hash` unpacks it).

:class:`AdapterError` (a :class:`~admm_dist.core.errors.UserError`) is defined here, below
:mod:`admm_dist.model.adapter`, which imports this module and re-exports it. This module
needs an adapter only through its ``numel``, ``identity()`` and ``model`` (:class:`Adapter`), so
it never imports :mod:`admm_dist.model.adapter`.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from typing import Any, Dict, Optional, Protocol, Sequence, Tuple

import torch

from admm_dist.core.errors import UserError
from admm_dist.core.io import atomic_write_bytes
from admm_dist.model.sharding import whole

VECTOR_KEY = "b"
VECTOR_FORMAT = "admm_dist.b_vector"
VECTOR_FORMAT_VERSION = 1


class Adapter(Protocol):
    """What this module reads of an adapter (:class:`~admm_dist.model.adapter.BOnlyLoRA`)."""
    numel: int
    model: Any
    backbone_id: Optional[Dict[str, Any]]

    def identity(self) -> Dict[str, Any]: ...


class AdapterError(UserError):
    """The adapter cannot be built, or a vector/file does not fit it; the message names the fix."""


def save_vector(path: str, vec: torch.Tensor, meta: Optional[Dict[str, Any]] = None, *,
                adapter: Optional[Adapter] = None) -> None:
    """Write ``vec`` (1-D, stored fp32) to a safetensors file under key "b", atomically.

    ``meta`` (JSON-serialisable) goes into the safetensors metadata; with ``adapter`` its
    identity (config, basis hash, layout, numel) is added under ``meta["adapter"]``, which
    :func:`load_vector` checks against the adapter it loads into.
    """
    from safetensors.torch import save as st_save

    if not isinstance(vec, torch.Tensor):
        raise AdapterError(f"save_vector expects a tensor, got {type(vec).__name__}")
    if not vec.is_floating_point():
        raise AdapterError(f"save_vector expects a float vector, got dtype {vec.dtype}")
    meta = dict(meta or {})
    if adapter is not None:
        if vec.numel() != adapter.numel:
            raise AdapterError(f"save_vector: vector has {vec.numel()} values but the adapter has "
                               f"P={adapter.numel}")
        meta["adapter"] = adapter.identity()
        backbone = backbone_identity(adapter)
        if backbone is not None:
            meta["adapter"]["backbone"] = backbone
    flat = vec.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
    try:
        meta_json = json.dumps(meta, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise AdapterError(f"save_vector: meta is not plain JSON ({exc}): pass str/int/float/list/dict "
                           f"values") from exc
    header = {"format": VECTOR_FORMAT, "format_version": str(VECTOR_FORMAT_VERSION),
              "numel": str(flat.numel()), "meta": meta_json}
    atomic_write_bytes(path, canonical_header(st_save({VECTOR_KEY: flat}, metadata=header)))


def canonical_header(blob: bytes) -> bytes:
    """The same safetensors file with its JSON header written in one order (keys sorted), so
    that the same vector and metadata always give the same bytes (safetensors writes the
    metadata map in hash order, which differs from process to process). The tensor bytes and
    their offsets, which are relative to the end of the header, are unchanged."""
    n = int.from_bytes(blob[:8], "little")
    text = json.dumps(json.loads(blob[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)   # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text + blob[8 + n:]


def load_vector(path: str, expect: Optional[Adapter] = None, *,
                backbone: bool = False) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """Read a file written by :func:`save_vector`: returns (fp32 CPU vector, meta).

    With ``expect``, the file's adapter identity must match that adapter (config fields,
    numel, basis hash, layout), else AdapterError names the field that differs. With
    ``backbone`` too, the backbone the file was trained on (:func:`backbone_identity`) must be
    ``expect``'s: a backbone of the same shape with other weights is refused, naming both.
    """
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise AdapterError(f"no B-vector file at {path}: check the path (it is written by save_vector)")
    try:
        with safe_open(path, framework="pt", device="cpu") as fh:
            header = fh.metadata() or {}
            keys = list(fh.keys())
            if VECTOR_KEY not in keys:
                raise AdapterError(f"{path} is a safetensors file without key {VECTOR_KEY!r} (keys: "
                                   f"{keys[:5]}): it is not a B vector written by save_vector")
            vec = fh.get_tensor(VECTOR_KEY)
    except AdapterError:
        raise
    except Exception as exc:  # safetensors raises its own error types for bad headers/data
        raise AdapterError(f"{path} is not a readable safetensors file ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}): it is corrupt or "
                           f"truncated; re-create it") from None
    if header.get("format") != VECTOR_FORMAT:
        raise AdapterError(f"{path} has format {header.get('format')!r}, not {VECTOR_FORMAT!r}: it is "
                           f"not a B vector written by save_vector")
    try:
        version = int(header.get("format_version", "0"))
    except ValueError:
        version = -1
    if version != VECTOR_FORMAT_VERSION:
        raise AdapterError(f"{path} has format version {header.get('format_version')!r}, this code reads "
                           f"version {VECTOR_FORMAT_VERSION}: re-save it with this version")
    try:
        meta = json.loads(header.get("meta", "{}"))
    except json.JSONDecodeError:
        raise AdapterError(f"{path} has unreadable metadata JSON: it is corrupt; re-create it") from None
    if vec.dim() != 1 or vec.dtype != torch.float32:
        raise AdapterError(f"{path}: key {VECTOR_KEY!r} is {vec.dtype} of shape {tuple(vec.shape)}, "
                           f"expected a 1-D float32 vector: re-create it with save_vector")
    if str(vec.numel()) != header.get("numel"):
        raise AdapterError(f"{path}: the vector has {vec.numel()} values but its header says "
                           f"{header.get('numel')}: it is corrupt; re-create it")
    if expect is not None:
        _check_identity(path, meta.get("adapter"), expect)
        if backbone:
            check_backbone(path, meta["adapter"].get("backbone"), expect)
    return vec, meta


BACKBONE_SAMPLES = 64   # values of each backbone tensor that its weight digest reads


def backbone_identity(adapter: Any) -> Optional[Dict[str, Any]]:
    """What a saved vector records of the backbone it was trained on: ``name`` (the folder or hub
    id it was loaded from) and ``weights``, a sha256 of every frozen tensor's name, shape and
    :data:`BACKBONE_SAMPLES` evenly spaced values rounded to bf16 (the same on CPU in fp32 and on
    a GPU in bf16; cheap for an 8B model). Two backbones of one shape (a fine-tune, another
    seed) differ in ``weights``. None for an adapter-like object without a ``model``. The backbone
    is frozen: the identity is computed once per adapter and kept. :class:`BOnlyLoRA` computes it
    when it is built, so a sharded backbone (:mod:`admm_dist.model.sharding`) is gathered then, on
    every rank of its group, and never again."""
    model = getattr(adapter, "model", None)
    if model is None or not hasattr(model, "named_parameters"):
        return None
    if getattr(adapter, "backbone_id", None) is not None:
        return adapter.backbone_id
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = (getattr(base, "name_or_path", None)
            or getattr(getattr(base, "config", None), "_name_or_path", None))
    h = hashlib.sha256()
    params = sorted((n.replace(".base_layer.", "."), p) for n, p in base.named_parameters()
                    if "lora_" not in n and not p.is_meta)
    for n, p in params:
        flat = whole(p.detach()).reshape(-1)   # a sharded weight gathered, one at a time
        step = max(1, flat.numel() // BACKBONE_SAMPLES)
        sample = flat[::step][:BACKBONE_SAMPLES].to("cpu").float().to(torch.bfloat16).float()
        h.update(f"{n}:{tuple(p.shape)}:".encode())
        h.update(sample.numpy().tobytes())
    adapter.backbone_id = {"name": str(name) if name else None, "weights": h.hexdigest()}
    return adapter.backbone_id


def check_backbone(path: str, theirs: Any, adapter: Adapter) -> None:
    """Refuse a file trained on another backbone than ``adapter``'s (by :func:`backbone_identity`'s
    weight digest), naming both. A file that records no backbone (saved without an adapter, as a
    vector made by hand for ``init_state``) is accepted: only its shape can be checked."""
    if not isinstance(theirs, dict) or not theirs.get("weights"):
        return
    mine = backbone_identity(adapter)
    if mine is None or mine["weights"] == theirs["weights"]:
        return
    trained = f"{theirs.get('name') or 'an unnamed backbone'} (weights {str(theirs['weights'])[:12]})"
    loaded = f"{mine['name'] or 'an unnamed backbone'} (weights {mine['weights'][:12]})"
    same = " (same name, other weights)" if theirs.get("name") == mine["name"] else ""
    hint = f" (--model_name {theirs['name']})" if theirs.get("name") else ""
    raise AdapterError(f"{path} was trained on backbone {trained} but the loaded backbone is {loaded}{same}: "
                       f"load it on the backbone it was trained on{hint}")


def _check_identity(path: str, ident: Any, adapter: Adapter) -> None:
    fix = "build the adapter with the file's settings and backbone, or start from a zero vector"
    if not isinstance(ident, dict):
        raise AdapterError(f"{path} carries no adapter identity (saved without adapter=): re-save it "
                           f"with save_vector(..., adapter=...) or load it with expect=None")
    mine = adapter.identity()
    theirs_cfg = ident.get("config")
    if not isinstance(theirs_cfg, dict):
        raise AdapterError(f"{path}: adapter identity has no config: re-save it with save_vector")
    for key, value in mine["config"].items():
        if theirs_cfg.get(key) != value:
            raise AdapterError(f"{path} was built with {key}={theirs_cfg.get(key)!r} but this adapter has "
                               f"{key}={value!r}: {fix}")
    if ident.get("numel") != mine["numel"]:
        raise AdapterError(f"{path} holds P={ident.get('numel')} B entries but this adapter has "
                           f"P={mine['numel']} (same adapter config, another backbone shape): {fix}")
    if ident.get("basis_hash") != mine["basis_hash"]:
        raise AdapterError(f"{path} was trained on lora A basis {str(ident.get('basis_hash'))[:12]}... but "
                           f"this adapter's basis is {mine['basis_hash'][:12]}...: use the same "
                           f"lora_basis_seed, backbone and torch version as the file")
    if ident.get("layout") != mine["layout"]:
        raise AdapterError(f"{path} has another B layout (module names/shapes/offsets) than this "
                           f"adapter: {fix}")


# ---------------------------------------------------------------------- cross-rank checks
def check_same_basis(hashes: Sequence[str]) -> None:
    """Raise AdapterError if the ranks' basis hashes (index = rank) are not all equal."""
    hashes = [str(h) for h in hashes]
    if len(set(hashes)) <= 1:
        return
    counts = Counter(hashes)
    top = max(counts.values())
    # the most common hash is the reference; on a tie, rank 0's
    ref = hashes[0] if counts[hashes[0]] == top else next(h for h in hashes if counts[h] == top)
    odd = [r for r, h in enumerate(hashes) if h != ref]
    same = [r for r, h in enumerate(hashes) if h == ref]
    raise AdapterError(f"lora A basis differs across ranks: ranks {odd} have basis hash(es) "
                       f"{sorted({hashes[r][:12] for r in odd})} but ranks {same} have {ref[:12]}; "
                       f"use the same lora_basis_seed and backbone (and lora_targets, "
                       f"lora_layers_last, lora_rank) on every rank")


def hash_to_int64_row(hex_hash: str) -> torch.Tensor:
    """A sha256 hex digest as a [1, 4] int64 tensor (a row of a control table)."""
    if not isinstance(hex_hash, str) or len(hex_hash) != 64:
        raise AdapterError(f"expected a 64-character sha256 hex digest, got {hex_hash!r}")
    try:
        words = [int(hex_hash[i:i + 16], 16) for i in range(0, 64, 16)]
    except ValueError:
        raise AdapterError(f"not a hex digest: {hex_hash!r}") from None
    signed = [w - (1 << 64) if w >= (1 << 63) else w for w in words]
    return torch.tensor([signed], dtype=torch.int64)


def int64_row_to_hash(row: torch.Tensor) -> str:
    """Inverse of :func:`hash_to_int64_row` (one row of 4 int64 values)."""
    vals = [int(v) for v in row.reshape(-1).tolist()]
    if len(vals) != 4:
        raise AdapterError(f"expected 4 int64 values, got {len(vals)}")
    return "".join(f"{v % (1 << 64):016x}" for v in vals)
