"""Preemption: SIGUSR2 noted from the start of a run to its last write, and what a batch script reads;
Ctrl-C (SIGINT) and SIGTERM turned into one clean stop (:class:`StopSignals`).

SLURM warns a job before its time limit (``#SBATCH --signal=B:USR2@120``); the batch script
(``launch/slurm.sbatch``) forwards the warning to *this job's* workers only, by the PIDs
they record here, never by name. The trainer acts on the note at the next safe point: after
set-up (nothing trained yet) or at the end of a round (every rank checkpoints that round).
A note that arrives during the final writes is ignored: the run is finishing anyway.

With ``ADMM_JOB_DIR`` set (the batch script sets it to ``logs/<job id>``), every worker
writes ``pids/<host>-rank<RANK>.pid`` there at start (whole or not at all: a temporary
``.<name>.*.tmp`` renamed into place, which the script's ``<host>-rank*.pid`` glob never
matches) and removes it at exit, and rank 0 writes ``status.json`` when it stops::

    {"state": "finished" | "preempted" | "failed" | "interrupted", "round": 12, "out": "runs/x",
     "message": "..."}

(``interrupted``: Ctrl-C or SIGTERM stopped the run where it was, ``round`` null; the checkpoints
written before stay and ``resume=auto`` continues after the last round every rank completed.)
The script requeues the job only when the state is ``preempted``. Without ``ADMM_JOB_DIR``
nothing is written and USR2 still stops the run cleanly.

A PID file goes away when its worker leaves, and one asked worker makes every rank leave (they
agree on the stop at the end of the round): so the script reads every PID file of a node before
it signals any of them, and signals them all at once (see ``launch/slurm.sbatch``).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from typing import TYPE_CHECKING, Callable, Optional

from admm_dist.core.errors import AdmmDistError
from admm_dist.core.io import atomic_write_json

if TYPE_CHECKING:
    from admm_dist.engine.control import Control

JOB_DIR_ENV = "ADMM_JOB_DIR"
STATES = ("finished", "preempted", "failed", "interrupted")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 20.0   # the longest a worker takes to leave after the first stop signal (torchrun SIGKILLs at 30 s)


class PreemptionFlag:
    """Notes SIGUSR2 (in the main thread); ``install`` returns the undo."""

    def __init__(self) -> None:
        self.noted = False

    def note(self, signum=None, frame=None) -> None:
        self.noted = True

    def install(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        old = signal.signal(signal.SIGUSR2, self.note)
        return lambda: signal.signal(signal.SIGUSR2, old)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM: the run stops where it is; what was checkpointed stays.
    A ``KeyboardInterrupt``, so no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum      # the shell's convention: 130 for SIGINT, 143 for SIGTERM


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopSignals:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread, once.

    A later one is only noted, so the clean-up the first began (PID file, status, process-group
    teardown) runs to its end: under torchrun one Ctrl-C reaches a worker twice, from the
    terminal and forwarded by the agent. :meth:`hold` makes even the first one a note (the run
    is already leaving for another reason). From the first signal on the process leaves within
    ``grace_s``, even while its main thread is stuck where a signal cannot reach Python (a
    collective whose peer left, under NCCL): a thread woken by the signal itself
    (``signal.set_wakeup_fd``) then calls ``on_deadline(signum)`` (one line) and ends the
    process with ``128 + signum``. A signal ignored when the process started stays ignored.
    """

    def __init__(self, grace_s: float = GRACE_S, on_deadline: Optional[Callable[[int], None]] = None):
        self.signum: Optional[int] = None
        self.held = False
        self.grace_s = grace_s
        self.on_deadline = on_deadline
        self._left = threading.Event()

    def handle(self, signum, frame=None) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if not self.held:
            raise Interrupted(signum)

    def hold(self) -> None:
        self.held = True

    def install(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s, h in old.items():
            if h is not signal.SIG_IGN:
                signal.signal(s, self.handle)
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            r = w = old_fd = -1
        else:
            threading.Thread(target=self._watch, args=(r,), daemon=True, name="admm-stop-deadline").start()

        def restore() -> None:
            self._left.set()
            for s, h in old.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            if w >= 0:
                with contextlib.suppress(ValueError, OSError):
                    signal.set_wakeup_fd(old_fd)
                os.close(w)      # the watcher sees the end of its pipe and leaves
        return restore

    def _watch(self, r: int) -> None:
        try:
            while True:
                data = os.read(r, 64)
                if not data:
                    return
                stops = [b for b in data if b in STOP_SIGNALS and signal.getsignal(b) == self.handle]
                if stops:
                    break
            if self._left.wait(self.grace_s):
                return
            if self.on_deadline is not None:
                with contextlib.suppress(Exception):
                    self.on_deadline(stops[0])
            os._exit(128 + stops[0])
        finally:
            with contextlib.suppress(OSError):
                os.close(r)


def job_dir(env: Optional[dict] = None) -> Optional[str]:
    env = os.environ if env is None else env
    return env.get(JOB_DIR_ENV) or None


def pid_path(folder: str, rank: int) -> str:
    host = socket.gethostname().split(".")[0]
    return os.path.join(folder, "pids", f"{host}-rank{rank}.pid")


def record_pid(rank: int) -> Callable[[], None]:
    """Write this worker's PID file under ``$ADMM_JOB_DIR``; returns the removal."""
    folder = job_dir()
    if folder is None:
        return lambda: None
    path = pid_path(folder, rank)
    me = os.getpid()
    atomic_write_json(path, me)

    def remove() -> None:
        # only by this process (not a fork of it) and only while the file still names it: a
        # newer worker of the same rank (a restart) may have put its own in its place
        if os.getpid() != me:
            return
        try:
            with open(path, encoding="utf-8") as fh:
                if fh.read().strip() != str(me):
                    return
            os.unlink(path)
        except OSError:
            pass
    return remove


def write_status(state: str, *, round_: Optional[int], out: str, message: str) -> None:
    """Rank 0's last word to the batch script (no-op without ``$ADMM_JOB_DIR``)."""
    if state not in STATES:
        raise ValueError(f"status {state!r}: one of {STATES}")
    folder = job_dir()
    if folder is None:
        return
    atomic_write_json(os.path.join(folder, "status.json"),
                      {"state": state, "round": round_, "out": out, "message": message})


class Preempted(AdmmDistError):
    """SIGUSR2 arrived (SLURM's warning before the time limit): every rank checkpointed the
    same round (or stopped after set-up) and stops; a requeued job continues with ``resume=auto``."""

    def __init__(self, round_: int, *, in_setup: bool = False):
        if not in_setup:
            msg = f"preempted after round {round_}: checkpoint written; rerun with resume=auto"
        elif round_ == 0:
            msg = ("preempted during set-up, before round 1: nothing to resume yet; rerun (resume=auto "
                   "starts at round 0)")
        else:
            msg = (f"preempted during set-up after resuming round {round_}: its checkpoint stands; "
                   "rerun with resume=auto")
        super().__init__(msg)
        self.round = round_


def agree(flag: "PreemptionFlag", control: "Control") -> bool:
    """True on every rank if the signal reached any rank."""
    return control.any(flag.noted)
