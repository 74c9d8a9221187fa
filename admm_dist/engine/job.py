"""What the ranks of one job tell one another outside their process group, through the store
torchrun's agent keeps for the whole job (``TORCHELASTIC_USE_AGENT_STORE``): it outlives every
worker, so it still answers when a rank has died or stopped.

- :class:`RollCall`: a collective that failed says only that a connection closed or a wait ran
  out. The rank that met it then calls the roll (:meth:`RollCall.silent`): a thread of every
  live rank answers at once, and the ranks that neither answer within :data:`SILENT_S` nor left
  on their own are named: killed, stopped (SIGSTOP) or cut off.
- :class:`FirstFailure`: the first failure of this attempt of the job, claimed by the rank that
  meets it first. A failure every rank meets alike (a bad setting, an ``out=`` in use, a world
  size that does not fit the seats) is then said once, and a rank that stops because of it
  (torchrun's agent SIGTERMs every other worker once one exits non-zero) says nothing.

Without an agent store (a launch that sets ``MASTER_ADDR`` itself, or torchrun under
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) there is no store that outlives rank 0: no rank is
named and every rank says its own line. Every store operation but a thread's wait for the next
roll call is bounded by :data:`STORE_TIMEOUT`; a store that does not answer is taken as absent.
"""
from __future__ import annotations

import contextlib
import datetime
import threading
import time
from typing import List, Optional, Tuple

import torch.distributed as dist

from admm_dist.engine.env import DistEnv

SILENT_S = 2.0             # a rank that has not answered a roll call in this long went away
POLL_S = 0.05              # how often the caller looks for the answers
STORE_TIMEOUT = datetime.timedelta(seconds=5)
ANSWER_WAIT = datetime.timedelta(days=365)   # a rank's thread waits for the next roll call for good


def agent_store(env: DistEnv) -> Optional[dist.Store]:
    """A client of the agent's store of this job, or None (no agent store, or it does not answer)."""
    if not (env.is_distributed and env.agent_store):
        return None
    try:
        return dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=STORE_TIMEOUT)
    except RuntimeError:   # DistNetworkError: the agent is gone
        return None


class RollCall:
    """This rank's answers to roll calls in the store (keys under ``prefix``, one group's
    generation), and the roll call a failing rank makes.

    A thread of this rank waits in the store for the next call (nothing is sent while it waits)
    and answers each one; a rank that leaves says so and wakes the threads with one last call.
    A roll call thus costs nothing until a rank fails or leaves: no traffic is added to what a
    run measures on its wire. ``main`` and ``waiter`` are two clients of the store (a client is
    held by a wait until it returns)."""

    def __init__(self, main: dist.Store, waiter: dist.Store, rank: int, world_size: int, prefix: str) -> None:
        self.store, self.rank, self.world_size = main, rank, world_size
        self.base = f"{prefix}/roll"
        self._left, self._gone = threading.Event(), threading.Event()
        # The thread waits for the next call and returns once this rank has left. The first call
        # it answers is numbered here, before it starts; numbered in the thread, a rank that
        # leaves at once could call before it, and the thread would wait for the call after its
        # own. For the same reason it looks whether the rank left before each wait: its answers
        # may have covered the rank's own last call (leave() sets the flag before it calls).
        try:
            due = main.add(f"{self.base}/calls", 0) + 1
        except RuntimeError:   # the store went away: nobody can call the roll
            self._gone.set()
            due = 0
        self._thread = threading.Thread(target=self._answer, args=(waiter, due), daemon=True,
                                        name="admm-roll-call")
        if due:
            self._thread.start()

    def _answer(self, store: dist.Store, due: int) -> None:
        try:
            while not self._left.is_set():
                store.wait([f"{self.base}/call/{due}"], ANSWER_WAIT)
                if self._left.is_set():
                    return
                last = store.add(f"{self.base}/calls", 0)
                for call in range(due, last + 1):
                    store.set(f"{self.base}/here/{call}/{self.rank}", "1")
                due = last + 1
        except RuntimeError:   # the store went away (torch has logged why): nobody is left to call
            self._gone.set()

    def _call(self) -> int:
        call = self.store.add(f"{self.base}/calls", 1)
        self.store.set(f"{self.base}/call/{call}", "1")
        return call

    def leave(self) -> None:
        """Say that this rank left on its own (it did not go away), and stop answering."""
        self._left.set()
        if self._gone.is_set():
            return
        with contextlib.suppress(RuntimeError):
            self.store.set(f"{self.base}/left/{self.rank}", "1")
            self._call()   # wakes this rank's thread, which ends (and the others', which answer)
        self._thread.join(STORE_TIMEOUT.total_seconds())

    def silent(self) -> List[int]:
        """The other ranks that neither answer a roll call within :data:`SILENT_S` nor left on
        their own: killed, stopped or cut off. It returns as soon as every other rank answered;
        [] if the store does not answer."""
        if self._gone.is_set():
            return []
        try:
            call, still = self._call(), {r for r in range(self.world_size) if r != self.rank}
            deadline = time.monotonic() + SILENT_S
            while still and time.monotonic() < deadline:
                time.sleep(POLL_S)
                still = {r for r in still if not self.store.check([f"{self.base}/here/{call}/{r}"])
                         and not self.store.check([f"{self.base}/left/{r}"])}
            return sorted(still)
        except RuntimeError:
            return []


def roll_call(env: DistEnv, prefix: str) -> Optional[RollCall]:
    """This rank's :class:`RollCall` in the agent's store, or None without one."""
    main, waiter = agent_store(env), agent_store(env)
    return (None if main is None or waiter is None
            else RollCall(main, waiter, env.rank, env.world_size, prefix))


class FirstFailure:
    """The first failure of this attempt of the job (``TORCHELASTIC_RESTART_COUNT``: a restarted
    attempt starts with none), as ``(rank, message)``."""

    def __init__(self, env: Optional[DistEnv]) -> None:
        self.rank = env.rank if env is not None else 0
        self.store = agent_store(env) if env is not None else None
        self.key = f"admm_dist/failed/attempt-{env.restart_count if env is not None else 0}"

    def claim(self, message: str) -> Optional[Tuple[int, str]]:
        """Record ``message`` as the job's first failure unless one is recorded. None: this rank's
        is the first (claimed now or before, or no store can say otherwise), and this rank says
        it; else the failure another rank recorded first."""
        if self.store is None:
            return None
        try:
            held = self.store.compare_set(self.key, "", f"{self.rank}:{message}")
        except RuntimeError:
            return None
        rank, first = _parse(held)
        return None if rank == self.rank else (rank, first)

    def amend(self, message: str) -> None:
        """The claimed failure's message, completed (the rank that went away, once known)."""
        if self.store is not None:
            with contextlib.suppress(RuntimeError):
                self.store.set(self.key, f"{self.rank}:{message}")

    def recorded(self) -> Optional[Tuple[int, str]]:
        """The failure some rank of this attempt claimed, if any."""
        if self.store is None:
            return None
        try:
            return _parse(self.store.get(self.key)) if self.store.check([self.key]) else None
        except RuntimeError:
            return None


def _parse(held: bytes) -> Tuple[int, str]:
    rank, _, message = held.decode("utf-8", "replace").partition(":")
    return int(rank), message
