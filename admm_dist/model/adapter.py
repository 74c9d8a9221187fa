"""B-only LoRA: the adapter whose trainable state is one flat fp32 vector (DESIGN.md section 2).

Design
------
A LoRA update of a projection W (out x in) is ``delta_W = (alpha / r) * B @ A`` with A of shape
(r, in) and B of shape (out, r). Here every A is a *frozen random basis* and only the B
matrices train. Because all nodes share the same A, averaging B's averages the weight
updates exactly (``mean_i(B_i) A = mean_i(B_i A)``), so consensus ADMM can run in B-space.

:class:`BOnlyLoRA` wraps a transformers causal LM with PEFT (``LoraConfig`` +
``get_peft_model``, on the last ``lora_layers_last`` decoder layers, on the projections named
by ``lora_targets``) and then:

* **A**: redrawn deterministically. A CPU ``torch.Generator`` seeded with ``lora_basis_seed``
  visits the LoRA-wrapped modules in sorted module-name order and fills each A with
  ``uniform(-1/sqrt(in), 1/sqrt(in))`` (the bound of PEFT's kaiming-uniform init); the result
  is moved to the model's device, kept fp32 and frozen. The draw depends only on the seed and
  the shapes, never on the device or the rank, so every rank gets the same bytes;
  :meth:`BOnlyLoRA.basis_hash` (sha256 over shapes and bytes, same order) lets ranks check
  that with :func:`check_same_basis` (:func:`hash_to_int64_row` packs a hash into a
  ``[1, 4]`` int64 row that a communicator's ``gather_rows`` can carry).
* **B**: *views* into one flat fp32 vector, no copies. ``self.flat`` (length ``P`` = total B
  entries, on the model's device) is the storage of the leaf ``self.param``; each lora_B
  weight's ``.data`` is ``flat[o:o+n].view(out, r)``. Likewise ``self.flat_grad`` is
  ``self.param.grad`` and each lora_B weight's ``.grad`` is the matching view of it, so
  autograd's AccumulateGrad adds into ``flat_grad`` *in place* during ``backward()``.
  An optimizer is built on ``[adapter.param]`` only; its in-place update of ``param`` is
  what PEFT's forward sees. ``zero_grad()`` zeroes ``flat_grad`` in place (it never sets
  grads to None, which would break the aliasing) and re-attaches any B grad that someone
  else cleared, so call it -- not ``optimizer.zero_grad()`` -- between steps.
  Moving the model after wrapping would re-allocate the B weights; put the backbone on its
  device first (``zero_grad``/``check_aliasing`` detect a broken alias and say so).
* **dtypes**: with a bf16 backbone (GPU) A and B stay fp32; PEFT casts the layer input to the
  LoRA weight dtype and the sum back to the base output dtype.

Files hold data, never code: :func:`save_vector` / :func:`load_vector` write and read a
safetensors file with the flat vector under key ``"b"`` and JSON metadata (the adapter's
identity: config, basis hash, layout, numel, plus the caller's fields), so loading a vector
into a differently-built adapter is one clear :class:`AdapterError`.
:meth:`BOnlyLoRA.export_peft` writes a standard PEFT adapter folder that
``PeftModel.from_pretrained(base, folder)`` loads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from admm_dist.core.io import atomic_write_bytes

LORA_TARGETS: Dict[str, Tuple[str, ...]] = {
    "attn_qv": ("q_proj", "v_proj"),
    "attn_all": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "attn_mlp": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}

ADAPTER_NAME = "default"
VECTOR_KEY = "b"
VECTOR_FORMAT = "admm_dist.b_vector"
VECTOR_FORMAT_VERSION = 1


class AdapterError(ValueError):
    """The adapter cannot be built, or a vector/file does not fit it; the message names the fix."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """How the B-only LoRA adapter is built (DESIGN.md section 2)."""

    lora_rank: int = 16
    lora_alpha: float = 16.0
    lora_layers_last: int = 36
    lora_targets: str = "attn_mlp"
    lora_basis_seed: int = 42

    def __post_init__(self) -> None:
        if not _is_int(self.lora_rank) or self.lora_rank < 1:
            raise AdapterError(f"lora_rank={self.lora_rank!r} is invalid: use an integer >= 1 (e.g. 16)")
        alpha = self.lora_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) \
                or alpha <= 0:
            raise AdapterError(f"lora_alpha={alpha!r} is invalid: use a positive finite number "
                               f"(the LoRA scale is lora_alpha / lora_rank; e.g. 16)")
        if not _is_int(self.lora_layers_last) or self.lora_layers_last < 1:
            raise AdapterError(f"lora_layers_last={self.lora_layers_last!r} is invalid: use an integer "
                               f">= 1 (LoRA goes on the last lora_layers_last decoder layers)")
        if self.lora_targets not in LORA_TARGETS:
            raise AdapterError(f"lora_targets={self.lora_targets!r} is unknown: use one of "
                               f"{', '.join(sorted(LORA_TARGETS))}")
        if not _is_int(self.lora_basis_seed) or not 0 <= self.lora_basis_seed < 2 ** 63:
            raise AdapterError(f"lora_basis_seed={self.lora_basis_seed!r} is invalid: use an integer "
                               f"in [0, 2**63) (the same on every rank)")

    @property
    def target_modules(self) -> Tuple[str, ...]:
        return LORA_TARGETS[self.lora_targets]

    @property
    def scaling(self) -> float:
        return float(self.lora_alpha) / self.lora_rank

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "AdapterConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise AdapterError(f"unknown adapter config keys {unknown}: valid keys are {sorted(known)}")
        return cls(**d)


def _num_layers(model) -> int:
    cfg = model.config
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    n = getattr(cfg, "num_hidden_layers", None)
    if not _is_int(n):
        raise AdapterError(f"cannot tell how many decoder layers {type(model).__name__} has "
                           f"(its config has no num_hidden_layers): use a transformers causal LM")
    return n


def _model_device(model) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if not devices:
        raise AdapterError("the model has no parameters: pass a transformers causal LM")
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise AdapterError(f"BOnlyLoRA needs the whole backbone on one device, found {names}: "
                           f"load it with device_map={{'': device}} or move it with .to(device) "
                           f"before wrapping")
    return devices.pop()


def _hash_tensors(tensors: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
        h.update(struct.pack(f"<{1 + t.dim()}q", t.dim(), *t.shape))
        h.update(t.numpy().astype("<f4", copy=False).tobytes())
    return h.hexdigest()


class BOnlyLoRA:
    """PEFT LoRA where only B trains; every A is a frozen random basis drawn from lora_basis_seed.

    ``model`` is wrapped in place (PEFT injects LoRA layers into it); ``self.model`` is the
    ``PeftModel``. The trainable state is ``self.param`` (a flat fp32 ``Parameter`` whose
    storage is ``self.flat``; its ``.grad`` is ``self.flat_grad``); every lora_B weight and
    its grad are views into those two vectors.
    """

    def __init__(self, model, config: AdapterConfig, *, fast_path: bool = True):
        from peft import LoraConfig, PeftModel, get_peft_model
        from peft.tuners.lora import LoraLayer

        if not isinstance(config, AdapterConfig):
            raise AdapterError(f"config must be an AdapterConfig, got {type(config).__name__}")
        if isinstance(model, PeftModel):
            raise AdapterError("the model is already a PeftModel: pass the plain backbone; "
                               "BOnlyLoRA adds its own LoRA layers")
        self.config = config
        n_layers = _num_layers(model)
        if config.lora_layers_last > n_layers:
            raise AdapterError(f"lora_layers_last={config.lora_layers_last} but the model has "
                               f"{n_layers} layers: use lora_layers_last between 1 and {n_layers}")
        self.num_layers = n_layers
        self.layers = list(range(n_layers - config.lora_layers_last, n_layers))
        device = _model_device(model)
        self.device = device

        lcfg = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                          target_modules=list(config.target_modules),
                          layers_to_transform=list(self.layers), lora_dropout=0.0, bias="none",
                          task_type="CAUSAL_LM")
        self.model = get_peft_model(model, lcfg, adapter_name=ADAPTER_NAME)

        base = self.model.get_base_model()
        lora_layers = sorted(((name, mod) for name, mod in base.named_modules()
                              if isinstance(mod, LoraLayer) and ADAPTER_NAME in mod.lora_A),
                             key=lambda nm: nm[0])
        if not lora_layers:
            raise AdapterError(f"no module of the model matches lora_targets={config.lora_targets!r} "
                               f"({', '.join(config.target_modules)}) in layers {self.layers}: "
                               f"choose targets this architecture has")
        self._names: List[str] = [n for n, _ in lora_layers]

        for p in self.model.parameters():
            p.requires_grad_(False)

        # A: one seeded CPU generator, sorted module order, kaiming-uniform bound, fp32, frozen.
        gen = torch.Generator(device="cpu").manual_seed(config.lora_basis_seed)
        a_cpu: List[torch.Tensor] = []
        self._a_weights: List[torch.nn.Parameter] = []
        for _, mod in lora_layers:
            lin = mod.lora_A[ADAPTER_NAME]
            r, fan_in = lin.weight.shape
            bound = 1.0 / math.sqrt(fan_in)
            a = torch.empty(r, fan_in, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
            a_cpu.append(a)
            lin.weight.data = a.to(device)
            lin.weight.requires_grad_(False)
            self._a_weights.append(lin.weight)
        self._basis_hash = _hash_tensors(a_cpu)
        del a_cpu

        # B: views into one flat fp32 vector (and its grad), sorted module order.
        shapes = [tuple(mod.lora_B[ADAPTER_NAME].weight.shape) for _, mod in lora_layers]
        total = sum(o * r for o, r in shapes)
        self.flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.flat_grad = torch.zeros(total, dtype=torch.float32, device=device)
        self.param = torch.nn.Parameter(self.flat)  # shares self.flat's storage
        self.param.grad = self.flat_grad
        self._layout: List[Tuple[str, Tuple[int, int], int]] = []
        self._b_weights: List[torch.nn.Parameter] = []
        off = 0
        for (name, mod), (out, r) in zip(lora_layers, shapes):
            n = out * r
            lin_b = mod.lora_B[ADAPTER_NAME]
            if getattr(lin_b, "bias", None) is not None:  # pragma: no cover - bias="none"
                raise AdapterError(f"lora_B of {name} has a bias: BOnlyLoRA needs bias='none'")
            w = lin_b.weight
            w.data = self.flat[off:off + n].view(out, r)
            w.requires_grad_(True)
            w.grad = self.flat_grad[off:off + n].view(out, r)
            self._b_weights.append(w)
            self._layout.append((name, (out, r), off))
            off += n
        self._numel = total
        self.check_aliasing()
        if fast_path:
            for _, mod in lora_layers:
                _install_fast_forward(mod)

    # ------------------------------------------------------------------ state
    @property
    def numel(self) -> int:
        """P: the number of B entries (the length of the flat vector)."""
        return self._numel

    def layout(self) -> List[Tuple[str, Tuple[int, int], int]]:
        """(module name, B shape (out, r), offset in the flat vector), in vector order."""
        return list(self._layout)

    def module_names(self) -> List[str]:
        return list(self._names)

    def basis_hash(self, *, recompute: bool = False) -> str:
        """sha256 hex of every A (shapes and fp32 bytes) in module order.

        ``recompute=True`` hashes the live A weights (copied to CPU) instead of the cached
        hash of the draw, to catch an A that changed after construction.
        """
        if recompute:
            return _hash_tensors(self._a_weights)
        return self._basis_hash

    def vector(self) -> torch.Tensor:
        """The flat fp32 B vector itself (no copy): writing into it changes the model."""
        return self.flat

    def load_vector(self, vec: torch.Tensor) -> None:
        """Copy ``vec`` (P values, any float dtype/device) into the flat B vector."""
        if not isinstance(vec, torch.Tensor):
            raise AdapterError(f"load_vector expects a tensor, got {type(vec).__name__}")
        if vec.numel() != self._numel:
            raise AdapterError(f"vector has {vec.numel()} values but this adapter has P={self._numel} "
                               f"B entries: it was built for another adapter config or backbone")
        with torch.no_grad():
            self.flat.copy_(vec.detach().reshape(-1))

    def zero_grad(self) -> None:
        """Zero ``flat_grad`` in place, keeping every B grad a view of it."""
        self.check_aliasing(repair_grads=True)
        self.flat_grad.zero_()

    def check_aliasing(self, *, repair_grads: bool = False) -> None:
        """Raise AdapterError if a B weight is no longer a view of ``flat``.

        With ``repair_grads`` a B grad (or ``param.grad``) that someone cleared or replaced
        (e.g. ``model.zero_grad(set_to_none=True)``) is re-attached to its ``flat_grad`` view.
        """
        esize = self.flat.element_size()
        base, gbase = self.flat.data_ptr(), self.flat_grad.data_ptr()
        if self.param.data_ptr() != base:
            raise AdapterError("adapter.param no longer shares storage with adapter.flat: do not "
                               "assign param.data; use load_vector()")
        if self.param.grad is None or self.param.grad.data_ptr() != gbase:
            if not repair_grads:
                raise AdapterError("adapter.param.grad is not adapter.flat_grad: use adapter.zero_grad(), "
                                   "not optimizer.zero_grad()")
            self.param.grad = self.flat_grad
        for w, (name, (out, r), off) in zip(self._b_weights, self._layout):
            if w.data_ptr() != base + off * esize:
                raise AdapterError(f"lora_B of {name} is no longer a view of the flat vector (was the "
                                   f"model moved or re-cast after wrapping?): put the backbone on its "
                                   f"device and dtype before building BOnlyLoRA")
            g = w.grad
            if g is None or g.data_ptr() != gbase + off * esize:
                if not repair_grads:
                    raise AdapterError(f"the grad of lora_B of {name} is not a view of flat_grad: call "
                                       f"adapter.zero_grad() (never set grads to None)")
                w.grad = self.flat_grad[off:off + out * r].view(out, r)

    # ------------------------------------------------------------------ running
    @contextlib.contextmanager
    def disabled(self) -> Iterator[Any]:
        """Run the backbone with every adapter off (reference log-probs); yields the model."""
        with self.model.disable_adapter():
            yield self.model

    def identity(self) -> Dict[str, Any]:
        """What a saved vector must match to be loaded into this adapter."""
        return {
            "config": self.config.to_dict(),
            "basis_hash": self._basis_hash,
            "numel": self._numel,
            "layout": [[n, list(s), o] for n, s, o in self._layout],
        }

    # ------------------------------------------------------------------ files
    def save(self, path: str, vec: Optional[torch.Tensor] = None,
             meta: Optional[Dict[str, Any]] = None) -> None:
        """Save ``vec`` (default: the current flat vector) with this adapter's identity."""
        save_vector(path, self.flat if vec is None else vec, meta or {}, adapter=self)

    def load(self, path: str) -> Dict[str, Any]:
        """Load a saved vector into the flat vector after checking it fits; returns its meta."""
        vec, meta = load_vector(path, self)
        self.load_vector(vec)
        return meta

    def export_peft(self, folder: str, vec: Optional[torch.Tensor] = None) -> str:
        """Write a standard PEFT adapter folder holding ``vec`` (default: the current B).

        ``PeftModel.from_pretrained(fresh_backbone, folder)`` then computes what this adapter
        computes. The folder is written to a temporary sibling, fsynced, then renamed into
        place (an existing folder is replaced). The adapter's own vector is left unchanged.
        """
        folder = os.path.abspath(folder)
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise AdapterError(f"export_peft: {folder} exists and is not a folder: choose another path")
        parent = os.path.dirname(folder)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", suffix=".tmp", dir=parent)
        saved = None
        try:
            if vec is not None:
                saved = self.flat.detach().clone()
                self.load_vector(vec)
            self.model.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False)
            for root, _, files in os.walk(tmp):
                for fn in files:
                    _fsync_path(os.path.join(root, fn))
                _fsync_path(root)
            if os.path.isdir(folder):
                old = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", suffix=".old", dir=parent)
                os.rmdir(old)
                os.replace(folder, old)
                os.replace(tmp, folder)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, folder)
            _fsync_path(parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if saved is not None:
                with torch.no_grad():
                    self.flat.copy_(saved)
        return folder


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- fast B-only forward
class _BOnlyLinear(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T with W, b and A frozen: one op, gradients for x and B only.

    PEFT's generic LoRA forward builds three autograd nodes per layer (A, B, the scaled
    add) and keeps their inputs. Here, in fp32, W + s B A is formed once (out x in, r
    multiply-adds per entry) and used for both passes; with a lower-precision base (bf16 on
    GPU) the base product stays in its dtype and only the rank-r path runs in fp32, as in
    PEFT. The backward returns dL/dx and dL/dB = s g^T (x A^T); nothing else.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scale):
        xa = torch.nn.functional.linear(x.to(a.dtype), a)             # [..., r]
        if weight.dtype == a.dtype and x.dtype == a.dtype:
            w_eff = torch.addmm(weight, b, a, alpha=scale)          # W + s B A
            y = torch.nn.functional.linear(x, w_eff, bias)
            ctx.save_for_backward(w_eff, xa, a, b)
            ctx.merged = True
        else:
            base = torch.nn.functional.linear(x, weight, bias)
            out = base.shape[-1]
            y = torch.addmm(base.reshape(-1, out).to(a.dtype), xa.reshape(-1, xa.shape[-1]), b.t(),
                            alpha=scale).reshape(base.shape).to(base.dtype)
            ctx.save_for_backward(weight, xa, a, b)
            ctx.merged = False
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g):
        w, xa, a, b = ctx.saved_tensors
        s = ctx.scale
        gx = gb = None
        out, r = b.shape
        if ctx.needs_input_grad[0]:
            if ctx.merged:
                gx = g @ w
            else:
                gx = (g @ w) + (s * ((g.to(b.dtype) @ b) @ a)).to(g.dtype)
        if ctx.needs_input_grad[4]:
            gb = s * (g.reshape(-1, out).to(b.dtype).t() @ xa.reshape(-1, r))
        return gx, None, None, None, gb, None


def _install_fast_forward(layer) -> None:
    """Route the layer's enabled-adapter forward through :class:`_BOnlyLinear`.

    Anything else (adapters disabled, merged weights, mixed adapter batches, extra
    arguments, dropout) keeps PEFT's own forward.
    """
    generic = layer.forward

    def forward(x, *args, **kwargs):
        if (args or kwargs or layer.disable_adapters or layer.merged
                or ADAPTER_NAME not in layer.active_adapters
                or not isinstance(layer.lora_dropout[ADAPTER_NAME], torch.nn.Identity)):
            return generic(x, *args, **kwargs)
        base = layer.base_layer
        return _BOnlyLinear.apply(x, base.weight, base.bias, layer.lora_A[ADAPTER_NAME].weight,
                                  layer.lora_B[ADAPTER_NAME].weight, layer.scaling[ADAPTER_NAME])

    layer.forward = forward


# ---------------------------------------------------------------------- vector files
def save_vector(path: str, vec: torch.Tensor, meta: Optional[Dict[str, Any]] = None, *,
                adapter: Optional[BOnlyLoRA] = None) -> None:
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
    flat = vec.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
    try:
        meta_json = json.dumps(meta, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise AdapterError(f"save_vector: meta is not plain JSON ({exc}): pass str/int/float/list/dict "
                           f"values") from exc
    header = {"format": VECTOR_FORMAT, "format_version": str(VECTOR_FORMAT_VERSION),
              "numel": str(flat.numel()), "meta": meta_json}
    atomic_write_bytes(path, st_save({VECTOR_KEY: flat}, metadata=header))


def load_vector(path: str, expect: Optional[BOnlyLoRA] = None) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """Read a file written by :func:`save_vector`: returns (fp32 CPU vector, meta).

    With ``expect``, the file's adapter identity must match that adapter (config fields,
    numel, basis hash, layout), else AdapterError names the field that differs.
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
    return vec, meta


def _check_identity(path: str, ident: Any, adapter: BOnlyLoRA) -> None:
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
    """A sha256 hex digest as a [1, 4] int64 tensor (for a communicator's gather_rows)."""
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
