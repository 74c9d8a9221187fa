"""The role-balanced minibatch sampler of a node's training examples.

Owns :class:`RoleBalancedSampler`: an infinite, deterministic, checkpointable stream of
minibatch index lists into a node's encoded examples (anything with a ``role``, e.g. the
:class:`~admm_dist.model.batches.Encoded` records of :func:`admm_dist.model.batches.encode`);
see the class for the balancing rule. Its state is part of a node's checkpoint.
"""
from __future__ import annotations

import hashlib
import random
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from admm_dist.core.errors import UserError


def _stream_seed(seed: int, key: str, epoch: int) -> int:
    h = hashlib.sha256(f"admm_dist.sampler|{seed}|{key}|{epoch}".encode("utf-8")).digest()
    return int.from_bytes(h[:8], "little")


class RoleBalancedSampler:
    """An infinite, deterministic stream of minibatches of indices into ``encoded``.

    Rule. With ``balance`` and K >= 2 roles (role names sorted), every batch of size b gives
    each role q = b // K slots, and the r = b % K remaining slots go to the next r roles of a
    cursor that rotates over the roles from batch to batch. So every batch holds q or q + 1
    examples of each role, and any K consecutive batches hold exactly K*q + r of each role,
    whatever the roles' sizes. Within a role, indices are drawn without replacement from a
    permutation of that role's examples; when it runs out, the next epoch of that role
    starts with a fresh permutation (small roles cycle faster; a role with fewer examples
    than its slots repeats within a batch). With one role or ``balance=False``, batches are
    consecutive slices of one permutation of all examples per epoch (an epoch boundary may
    fall inside a batch). Every permutation is a pure function of (seed, role, epoch).

    ``state_dict()`` is a small JSON-safe dict (per-stream epoch and position, the cursor);
    ``load_state_dict`` on a sampler built from the same examples, batch size, seed and
    ``balance`` continues the identical stream, and refuses a state from different ones.
    """

    VERSION = 1

    def __init__(self, encoded: Sequence[Any], batch_size: int, seed: int, balance: bool = True):
        if batch_size < 1:
            raise UserError(f"batch_size={batch_size} must be >= 1")
        if not encoded:
            raise UserError("RoleBalancedSampler needs at least one example")
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        roles = [str(getattr(e, "role", e)) for e in encoded]
        groups: Dict[str, List[int]] = {}
        for i, r in enumerate(roles):
            groups.setdefault(r, []).append(i)
        self.roles = sorted(groups)
        self.balanced = bool(balance) and len(self.roles) > 1
        self.balance = bool(balance)
        self._groups = {r: groups[r] for r in self.roles} if self.balanced \
            else {"*": list(range(len(roles)))}
        self._fingerprint = hashlib.sha256("\n".join(roles).encode("utf-8")).hexdigest()[:16]
        self._state = {k: {"epoch": 0, "pos": 0} for k in self._groups}
        self._cursor = 0
        self._drawn = 0
        self._perm: Dict[str, Tuple[int, List[int]]] = {}

    def _permutation(self, key: str, epoch: int) -> List[int]:
        cached = self._perm.get(key)
        if cached is None or cached[0] != epoch:
            idx = list(self._groups[key])
            random.Random(_stream_seed(self.seed, key, epoch)).shuffle(idx)
            cached = self._perm[key] = (epoch, idx)
        return cached[1]

    def _draw(self, key: str, k: int) -> List[int]:
        st, out = self._state[key], []
        while len(out) < k:
            perm = self._permutation(key, st["epoch"])
            take = perm[st["pos"]:st["pos"] + (k - len(out))]
            out += take
            st["pos"] += len(take)
            if st["pos"] >= len(perm):
                st["epoch"] += 1
                st["pos"] = 0
        return out

    def next_batch(self) -> List[int]:
        b = self.batch_size
        if not self.balanced:
            out = self._draw("*", b)
        else:
            K = len(self.roles)
            q, r = divmod(b, K)
            extra = {(self._cursor + j) % K for j in range(r)}
            out = []
            for j, role in enumerate(self.roles):
                out += self._draw(role, q + (1 if j in extra else 0))
            self._cursor = (self._cursor + r) % K
        self._drawn += 1
        return out

    def __iter__(self) -> Iterator[List[int]]:
        while True:
            yield self.next_batch()

    @property
    def batches_drawn(self) -> int:
        return self._drawn

    def _identity(self) -> Dict[str, Any]:
        return {"seed": self.seed, "batch_size": self.batch_size, "balance": self.balance,
                "n_examples": sum(len(g) for g in self._groups.values()),
                "roles_fingerprint": self._fingerprint}

    def state_dict(self) -> Dict[str, Any]:
        return {"version": self.VERSION, **self._identity(),
                "streams": {k: dict(v) for k, v in self._state.items()},
                "cursor": self._cursor, "batches_drawn": self._drawn}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("version") != self.VERSION:
            raise UserError(f"sampler state version {state.get('version')!r} is not "
                            f"{self.VERSION}: resume with the code that wrote it")
        diff = {k: (state.get(k), v) for k, v in self._identity().items() if state.get(k) != v}
        if diff:
            raise UserError(f"sampler state was saved for other settings (saved, now): {diff}; "
                            f"resume with the same examples, batch_size, seed and role balance")
        streams = state.get("streams", {})
        if set(streams) != set(self._state):
            raise UserError(f"sampler state streams {sorted(streams)} do not match "
                            f"{sorted(self._state)}: resume with the same examples")
        for k, v in streams.items():
            epoch, pos = int(v["epoch"]), int(v["pos"])
            if epoch < 0 or not 0 <= pos < len(self._groups[k]):
                raise UserError(f"sampler state for {k!r} is out of range: {v}")
            self._state[k] = {"epoch": epoch, "pos": pos}
        self._cursor = int(state["cursor"]) % max(1, len(self.roles))
        self._drawn = int(state["batches_drawn"])
