"""Running the model's own code on fake tensors, and counting the memory it would hold.

:class:`FakeRun` is a context in which torch computes shapes, dtypes and strides but no values
(``FakeTensorMode``): an 8B backbone, its activations and its optimizer state take no memory,
and the code that builds and trains them runs unchanged. Three rules make that code run:

- **Small host tensors are real.** A tensor made from Python data or a factory that comes to
  less than :data:`REAL_BYTES` (a batch's token ids, masks, positions) is made for real, and an
  op whose tensor inputs are all such real tensors runs for real, so what depends on their values
  (which positions are scored, how many tokens a mask holds) is computed. Anything larger, and
  anything computed from a fake tensor, is fake.
- **Reading a fake value gives a stand-in.** ``.item()``/``float()`` give 1 (a loss, a norm),
  ``.numpy()`` zeros of its shape (a digest), ``.data_ptr()`` where the value would lie in its
  storage (so views of one storage still alias). No shape may depend on such a value.
- **Every live tensor is counted.** Each storage an op makes is counted from its birth until
  Python frees it, at its size of the moment (a storage resized in place, as FSDP2 gathers a
  weight into one and frees it, is followed): :attr:`FakeRun.now` is what is held,
  :attr:`FakeRun.peak` the most held since :meth:`FakeRun.mark`. Fake and real alike
  (:class:`Counting` alone measures a real run); the CPU is where it runs, and bytes do not
  depend on the device.

The rehearsal of a job (:mod:`admm_dist.training.rehearsal`) runs a rank's set-up and x-step in
one, under torch's ``fake`` process group (:func:`admm_dist.engine.dist.rehearsal_world`).
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Optional

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

REAL_BYTES = 1 << 20     # a factory's output below this is made for real
_SCALAR = torch.ops.aten._local_scalar_dense.default


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor) or t.is_meta


class _Values(TorchDispatchMode):
    """Real where every input is real (or a small factory); a stand-in for a fake value read back."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if func is _SCALAR and _is_fake(args[0]):
            return True if args[0].dtype == torch.bool else 1.0 if args[0].is_floating_point() else 1
        if tensors and not any(_is_fake(t) for t in tensors):
            with _disable_current_modes():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not tensors:   # a factory: real when it is small (made from Python data, a mask)
            made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            device = kwargs.get("device")
            if made and all(t.untyped_storage().nbytes() < REAL_BYTES for t in made) and \
                    (device is None or torch.device(device).type != "meta"):
                with _disable_current_modes():
                    return func(*args, **kwargs)
        return out


class _Reads(TorchFunctionMode):
    """What Python reads out of a fake tensor without an op: ``numpy``, ``tolist``, ``data_ptr``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], FakeTensor):
            t = args[0]
            if func is torch.Tensor.numpy:   # a real empty tensor of its dtype says numpy's dtype
                with _disable_current_modes():
                    like = torch.empty(0, dtype=t.dtype).numpy()
                return np.zeros(tuple(t.shape), dtype=like.dtype)
            if func is torch.Tensor.tolist:
                return np.zeros(tuple(t.shape)).tolist()
            if func is torch.Tensor.data_ptr:
                return t.untyped_storage()._cdata + t.storage_offset() * t.element_size()
        return func(*args, **kwargs)


class Counting(TorchDispatchMode):
    """Every storage an op makes, counted until it is freed: :attr:`now` held, :attr:`peak` the
    most held at once since :meth:`mark`. On its own (real tensors) it measures a real run the
    way :class:`FakeRun` counts a rehearsal."""

    def __init__(self) -> None:
        super().__init__()
        self.live: Dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def add(self, t: torch.Tensor) -> None:
        self._storage(t.untyped_storage())

    def _storage(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        if key in self.live:
            return
        n = st.nbytes()
        self.live[key] = n
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(st, self._free, key)

    def _resized(self, st: torch.UntypedStorage) -> None:
        """A storage's new size (FSDP2 frees a gathered weight by resizing its storage to 0 and
        gathers it again into the same storage: no op a dispatch mode sees)."""
        key = st._cdata
        if key not in self.live:
            return self._storage(st)
        n = st.nbytes()
        self.now += n - self.live[key]
        self.live[key] = n
        self.peak = max(self.peak, self.now)

    def __enter__(self):
        count, resize = self, torch.UntypedStorage.resize_
        self._resize = resize

        def resize_(st, size):
            out = resize(st, size)
            count._resized(st)
            return out
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.add(t)
        return out

    def mark(self) -> int:
        """Start a phase: the peak from here on starts at what is held now (returned)."""
        self.peak = self.now
        return self.now


class FakeRun:
    """A context of fake tensors with small real ones, counting what is held (module docstring)."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.count = Counting()
        self._modes = [self.mode, _Values(), _Reads(), self.count]

    def __enter__(self) -> Counting:
        """The count of what the run holds (its ``now``, ``peak`` and ``mark``)."""
        for m in self._modes:
            m.__enter__()
        return self.count

    def __exit__(self, *exc: Any) -> Optional[bool]:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        return None
