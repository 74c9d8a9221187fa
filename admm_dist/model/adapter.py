"""B-only LoRA: the adapter whose trainable state is one flat fp32 vector (docs/design.md section 1).

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
  that with :func:`~admm_dist.model.vectors.check_same_basis`.
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
* **forward**: unless built with ``fast_path=False``, every wrapped layer runs the fused
  B-only linear of :mod:`admm_dist.model.fused_lora` (one autograd op instead of PEFT's three).
* **bounds**: before PEFT allocates anything, :func:`check_fits` refuses a ``lora_rank`` above the
  smallest dimension (in or out) of the projections it adapts (a rank-r update of an m x n matrix
  has rank at most min(m, n): a larger r only costs memory) and a ``lora_layers_last`` above the
  backbone's layers, each read from the backbone (its module shapes, its config).

:meth:`BOnlyLoRA.save` / :meth:`BOnlyLoRA.load` write and read the B vector with its identity
through :mod:`admm_dist.model.vectors` (the file format, the cross-rank basis checks, and
:class:`AdapterError`, defined there and re-exported here). :meth:`BOnlyLoRA.export_peft`
writes a standard PEFT adapter folder that ``PeftModel.from_pretrained(base, folder)`` loads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import shutil
import struct
import tempfile
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from admm_dist.core.config_file import check_bounds, key
from admm_dist.core.text import is_int
from admm_dist.model.fused_lora import install_fused_forward
from admm_dist.model.sharding import whole
from admm_dist.model.vectors import AdapterError, backbone_identity, load_vector, save_vector

LORA_TARGETS: Dict[str, Tuple[str, ...]] = {
    "attn_qv": ("q_proj", "v_proj"),
    "attn_all": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "attn_mlp": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}

ADAPTER_NAME = "default"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """How the B-only LoRA adapter is built (docs/design.md section 1)."""

    lora_rank: int = key(16, "LoRA rank r (at most the smallest dimension of the projections it adapts)",
                         at_least=1)
    lora_alpha: float = key(16.0, "LoRA scale numerator: the update is (lora_alpha / lora_rank) B A", above=0)
    lora_layers_last: int = key(36, "LoRA goes on the last this many decoder layers (at most the backbone's)",
                                at_least=1)
    lora_targets: str = key("attn_mlp", "projections that get LoRA: attn_qv (q, v), attn_all (q, k, v, o), "
                            "attn_mlp (those and gate, up, down)", choices=LORA_TARGETS)
    lora_basis_seed: int = key(42, "seed of the frozen random basis A (the same on every rank)")

    def __post_init__(self) -> None:
        check_bounds(self, AdapterError)
        for name in ("lora_rank", "lora_layers_last"):
            if not is_int(getattr(self, name)):
                raise AdapterError(f"{name}={getattr(self, name)!r}: use an integer >= 1")
        if self.lora_targets not in LORA_TARGETS:
            raise AdapterError(f"lora_targets={self.lora_targets!r} is unknown: use one of "
                               f"{', '.join(sorted(LORA_TARGETS))}")
        if not is_int(self.lora_basis_seed) or not 0 <= self.lora_basis_seed < 2 ** 63:
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
    if not is_int(n):
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


def smallest_adapted_dim(model, config: AdapterConfig, layers: Sequence[int]) -> Optional[int]:
    """The smallest dimension (in or out features) of the linear projections of ``model`` that
    ``config`` adapts in decoder layers ``layers``, read from the module shapes (no allocation);
    None when no module matches (:class:`BOnlyLoRA` then says so)."""
    wanted = set(config.target_modules)
    in_layers = {f".{i}." for i in layers}          # model.layers.<i>.self_attn.q_proj
    dims = [min(mod.in_features, mod.out_features) for name, mod in model.named_modules()
            if name.rsplit(".", 1)[-1] in wanted and hasattr(mod, "in_features")
            and hasattr(mod, "out_features") and any(part in name for part in in_layers)]
    return min(dims) if dims else None


def check_fits(model, config: AdapterConfig) -> List[int]:
    """Refuse, in one line and before anything is allocated, an adapter larger than ``model``:
    ``lora_layers_last`` above its decoder layers, ``lora_rank`` above the smallest dimension of the
    projections it adapts. Returns the adapted layers."""
    n_layers = _num_layers(model)
    if config.lora_layers_last > n_layers:
        raise AdapterError(f"lora_layers_last={config.lora_layers_last} but the model has "
                           f"{n_layers} layers: use lora_layers_last between 1 and {n_layers}")
    layers = list(range(n_layers - config.lora_layers_last, n_layers))
    dim = smallest_adapted_dim(model, config, layers)
    if dim is not None and config.lora_rank > dim:
        name = getattr(model.config, "name_or_path", "") or type(model).__name__
        raise AdapterError(f"lora_rank={config.lora_rank} exceeds {dim}, the smallest dimension of the "
                           f"projections it adapts ({config.lora_targets}: "
                           f"{', '.join(config.target_modules)}) in {name}: use at most {dim}")
    return layers


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
        self.layers = check_fits(model, config)     # before PEFT allocates A and B
        self.num_layers = _num_layers(model)
        device = _model_device(model)
        self.device = device

        lcfg = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                          target_modules=list(config.target_modules),
                          layers_to_transform=list(self.layers), lora_dropout=0.0, bias="none",
                          task_type="CAUSAL_LM")
        # PEFT makes its A and B on the meta device (nothing drawn, nothing allocated): both are
        # replaced below by this adapter's own parameters
        self.model = get_peft_model(model, lcfg, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=True)

        base = self.model.get_base_model()
        lora_layers = sorted(((name, mod) for name, mod in base.named_modules()
                              if isinstance(mod, LoraLayer) and ADAPTER_NAME in mod.lora_A),
                             key=lambda nm: nm[0])
        if not lora_layers:
            raise AdapterError(f"no module of the model matches lora_targets={config.lora_targets!r} "
                               f"({', '.join(config.target_modules)}) in layers {self.layers}: "
                               f"choose targets this architecture has")

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
            lin.weight = torch.nn.Parameter(a.to(device), requires_grad=False)
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
            # a parameter that shares flat's storage
            w = lin_b.weight = torch.nn.Parameter(self.flat[off:off + n].view(out, r))
            w.grad = self.flat_grad[off:off + n].view(out, r)
            self._b_weights.append(w)
            self._layout.append((name, (out, r), off))
            off += n
        self._numel = total
        self.check_aliasing()
        # What is read of the frozen backbone, read once, now (a sharded weight is gathered by
        # every rank of its group, in the same order): ||W||^2 of each adapted projection, in
        # layout order, for delta_w_rel, and the digest saved vectors record.
        base = self.model.get_base_model()
        self.base_sq = [float(whole(base.get_submodule(name).base_layer.weight).float().pow(2).sum())
                        for name, _, _ in self._layout]
        self.backbone_id: Optional[Dict[str, Any]] = None
        self.backbone_id = backbone_identity(self)
        if fast_path:
            for _, mod in lora_layers:
                install_fused_forward(mod, ADAPTER_NAME)

    # ------------------------------------------------------------------ state
    @property
    def numel(self) -> int:
        """P: the number of B entries (the length of the flat vector)."""
        return self._numel

    def layout(self) -> List[Tuple[str, Tuple[int, int], int]]:
        """(module name, B shape (out, r), offset in the flat vector), in vector order."""
        return list(self._layout)

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
        place (an existing folder is replaced). The folder and its files get the modes a plain
        ``mkdir``/``open`` would give them (0777/0666 less the umask), so a serving account
        can read them. The adapter's own vector is left unchanged.
        """
        from admm_dist.core.io import current_umask

        folder = os.path.abspath(folder)
        if os.path.exists(folder) and not os.path.isdir(folder) and not os.path.islink(folder):
            raise AdapterError(f"export_peft: {folder} exists and is not a folder: choose another path")
        parent = os.path.dirname(folder)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", suffix=".tmp", dir=parent)
        saved = None
        try:
            if vec is not None:
                saved = self.flat.detach().clone()
                self.load_vector(vec)
            peft_config = self.model.peft_config[ADAPTER_NAME]
            targets = peft_config.target_modules   # PEFT holds a set: saved in hash order, sorted here
            peft_config.target_modules = sorted(targets)
            try:
                self.model.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False)
            finally:
                peft_config.target_modules = targets
            # the modes a plain mkdir/open gives (mkdtemp's 0700, safetensors' 0600 not)
            umask = current_umask()
            for root, _, files in os.walk(tmp):
                for fn in files:
                    os.chmod(os.path.join(root, fn), 0o666 & ~umask)
                    _fsync_path(os.path.join(root, fn))
                os.chmod(root, 0o777 & ~umask)
                _fsync_path(root)
            if os.path.islink(folder):   # a link is replaced, never followed
                os.unlink(folder)
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
