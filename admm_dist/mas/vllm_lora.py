"""Seat states as vLLM LoRA adapters, for :class:`admm_dist.mas.vllm_backend.VLLMBackend`.

The trainable part of a seat, its flat B vector (:mod:`admm_dist.model.adapter`), reaches
the engine as a LoRA adapter on disk: for a ``state`` :class:`LoRAStates` writes a standard
PEFT folder with ``adapter.export_peft(workdir/lora-<sha>, state)`` (``sha`` is
:func:`state_hash`, over the vector's fp32 bytes) and hands out ``LoRARequest(name, int_id,
path)``. Every distinct state gets a fresh ``int_id``, so a state that changed (re-collection
after a training round) is a new adapter to vLLM and is loaded from its new folder without
restarting the engine; the same state is reused from the cache. The cache is bounded
(:data:`MAX_STATES`): the least recently used state is removed from the engine
(``remove_lora``) and its folder deleted. Exporting leaves the adapter's own vector as it was.
"""
from __future__ import annotations

import collections
import hashlib
import os
import shutil
from typing import Callable

import torch

MAX_STATES = 8                   # distinct seat states kept as adapters (folders + engine slots)


def state_hash(vec: torch.Tensor) -> str:
    """sha256 over a B vector's length and fp32 little-endian bytes."""
    flat = vec.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
    h = hashlib.sha256(str(flat.numel()).encode())
    h.update(flat.numpy().astype("<f4", copy=False).tobytes())
    return h.hexdigest()


class LoRAStates:
    """The seat states one engine serves: a least-recently-used cache of exported adapters.

    ``make_request(name, int_id, path)`` builds vLLM's ``LoRARequest``; ``remove(int_id)``
    unloads an adapter from the engine (it may raise: an adapter no request used was never
    loaded, and a closed engine has none). ``len()`` is the number of states held.
    """

    def __init__(self, adapter, workdir: str, make_request: Callable, remove: Callable[[int], None],
                 max_states: int = MAX_STATES):
        self.adapter, self.workdir = adapter, workdir
        self.max_states = int(max_states)
        self._make, self._remove = make_request, remove
        self._reqs: "collections.OrderedDict[str, object]" = collections.OrderedDict()
        self.next_id = 1           # the int_id the next new state gets (ids are never reused)

    def __len__(self) -> int:
        return len(self._reqs)

    def request(self, state: torch.Tensor):
        """The ``LoRARequest`` serving ``state`` (a flat B vector the adapter's size), exported
        on first use; the least recently used state beyond :attr:`max_states` is dropped."""
        sha = state_hash(state)
        req = self._reqs.get(sha)
        if req is not None:
            self._reqs.move_to_end(sha)
            return req
        path = self.adapter.export_peft(os.path.join(self.workdir, f"lora-{sha[:16]}"), state)
        req = self._make(f"state-{sha[:16]}", self.next_id, path)
        self.next_id += 1
        self._reqs[sha] = req
        while len(self._reqs) > self.max_states:
            _, old = self._reqs.popitem(last=False)
            self._drop(old)
        return req

    def _drop(self, req) -> None:
        try:
            self._remove(req.lora_int_id)
        except Exception:   # never loaded (no request used it) or the engine is gone
            pass
        shutil.rmtree(req.lora_path, ignore_errors=True)

    def clear(self) -> None:
        """Forget every state and delete its folder (the engine is left alone: it is closing)."""
        for req in list(self._reqs.values()):
            shutil.rmtree(req.lora_path, ignore_errors=True)
        self._reqs.clear()
