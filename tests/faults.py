"""Test-only fault injection, kept out of the run's configuration and out of the package.

``ADMM_DIST_FAULT_AT`` in a worker's environment plans one fault:

- ``ROUND:NODE``: the rank holding NODE exits (code 17) right after round ROUND's checkpoint,
  on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so an elastic restart resumes;
- ``nan@ROUND:NODE``: NODE's local loss is NaN in round ROUND (the engine must stop the run
  with the round and node named);
- ``ckpt@ROUND:NODE:POINT``: the rank holding NODE is SIGKILLed (by its own PID) while it writes
  NODE's checkpoint of round ROUND, at POINT, on the first attempt only. POINT is one of
  :data:`POINTS`: before the tensors, with the tensors' temporary written but not renamed,
  between the tensors and the JSON marker, with the marker's temporary not renamed, or right
  after the marker.

Nothing in ``admm_dist`` knows of it: :func:`install` arms a plan in the current process from
outside. A kill after a round wraps ``Trainer.track`` (called once per round, right after its
checkpoint); a NaN wraps ``Trainer.xstep`` (node NODE's x-step of round ROUND gets NaN for each
step's loss, after the real gradient); a kill inside a checkpoint write is an audit hook
(:func:`sys.addaudithook`) that watches CPython's ``open`` (``os.open``) and ``os.rename``
(``os.replace``) events for the files of NODE's round-ROUND checkpoint (``round-NNNNNN/node-N.*``).

Processes that tests start run :mod:`tests.fault_train` (``python -m tests.fault_train ARGS``, or
``torchrun ... -m tests.fault_train ARGS``), which installs :func:`from_env`'s plan and runs the
training command; ranks forked by the launcher (``conftest.cli_rank``) and in-process runs
(:func:`armed`) install it before the trainer is built. Import this module under one name in a
process (``faults`` in tests, ``tests.faults`` in processes started from the repository root).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import signal
import sys
from typing import Any, Dict, Iterable, Iterator, Optional, Sequence, Union

from admm_dist.core.errors import UserError

ENV = "ADMM_DIST_FAULT_AT"
EXIT_CODE = 17
POINTS = ("tensors", "tensors-renaming", "tensors-written", "json-renaming", "json-written")


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    kind: str        # "kill", "nan" or "ckpt"
    round: int
    node: int
    point: str = ""  # ckpt: where in the checkpoint write

    @classmethod
    def parse(cls, spec: str) -> "FaultPlan":
        kind = "nan" if spec.startswith("nan@") else "ckpt" if spec.startswith("ckpt@") else "kill"
        parts = spec.split("@", 1)[-1].split(":")
        point = parts.pop() if kind == "ckpt" and len(parts) == 3 else ""
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or (kind == "ckpt") != bool(point) \
                or (point and point not in POINTS):
            raise UserError(f"{ENV}={spec!r}: write ROUND:NODE, nan@ROUND:NODE or ckpt@ROUND:NODE:POINT "
                            f"(POINT one of {', '.join(POINTS)}), e.g. 3:1")
        return cls(kind, int(parts[0]), int(parts[1]), point)

    def poison(self, round_: int, node: int) -> bool:
        """True if ``node``'s loss in ``round_`` is to be NaN."""
        return self.kind == "nan" and self.round == round_ and self.node == node

    def after_round(self, round_: int, nodes: Sequence[int]) -> None:
        """Exit this process if the plan kills one of its ``nodes`` after ``round_``."""
        if self.kind == "kill" and self.round == round_ and self.node in nodes and _first_attempt():
            os._exit(EXIT_CODE)

    def kills_checkpoint(self, round_: int, node: int, point: str) -> bool:
        """True if the plan kills ``node``'s checkpoint write of ``round_`` at ``point`` (this attempt)."""
        return self.kind == "ckpt" and (self.round, self.node, self.point) == (round_, node, point) \
            and _first_attempt()

    def in_checkpoint(self, round_: int, node: int, point: str) -> None:
        """SIGKILL this process if the plan kills ``node``'s checkpoint write of ``round_`` here."""
        if self.kills_checkpoint(round_, node, point):
            os.kill(os.getpid(), signal.SIGKILL)


def from_env() -> Optional[FaultPlan]:
    spec = os.environ.get(ENV)
    return FaultPlan.parse(spec) if spec else None


def _first_attempt() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


# --------------------------------------------------------------------------- arming a plan
_plan: Optional[FaultPlan] = None
_patched: Dict[str, Any] = {}      # Trainer's attribute -> the original, while a plan is installed
_hooked = False                    # the audit hook (it cannot be removed: a no-op without a plan)


def install(plan: Union[FaultPlan, str, None]) -> None:
    """Arm ``plan`` (a :class:`FaultPlan` or its spec) in this process; None disarms (the
    wrapped trainer methods are restored; the audit hook, once added, stays and does nothing)."""
    global _plan, _hooked
    _plan = FaultPlan.parse(plan) if isinstance(plan, str) else plan
    if _plan is None or _plan.kind == "ckpt":   # only a kill after a round and a NaN wrap the trainer
        if _patched:
            from admm_dist.training.trainer import Trainer
            for name, original in _patched.items():
                setattr(Trainer, name, original)
            _patched.clear()
    elif not _patched:
        from admm_dist.training.trainer import Trainer
        for name, wrap in (("track", _track), ("xstep", _xstep)):
            _patched[name] = Trainer.__dict__[name]
            setattr(Trainer, name, _wrapped(wrap, _patched[name]))
    if _plan is not None and _plan.kind == "ckpt" and not _hooked:
        sys.addaudithook(_audit)
        _hooked = True


@contextlib.contextmanager
def armed(plan: Union[FaultPlan, str, None]) -> Iterator[Optional[FaultPlan]]:
    """:func:`install` ``plan`` for the block (in-process runs: a NaN; a kill would end the caller)."""
    install(plan)
    try:
        yield _plan
    finally:
        install(None)


def _wrapped(wrap: Any, original: Any) -> Any:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return wrap(original, self, *args, **kwargs)
    return method


def _track(original: Any, trainer: Any, rec: Any) -> None:
    """The round's tracking, then the planned exit after round ``rec.round``'s checkpoint."""
    original(trainer, rec)
    if _plan is not None:
        _plan.after_round(rec.round, trainer.nodes)


def _xstep(original: Any, trainer: Any, node: int, *args: Any, **kwargs: Any) -> float:
    """Node ``node``'s x-step; in the planned round, every step's loss NaN (its gradient is
    still computed, so a seat group's ranks run the same collectives)."""
    if _plan is None or not _plan.poison(trainer.engine.round, node):
        return original(trainer, node, *args, **kwargs)
    steps = trainer.local_steps
    real = steps.gradient
    steps.gradient = lambda st, idx: (real(st, idx), float("nan"))[1]
    try:
        return original(trainer, node, *args, **kwargs)
    finally:
        del steps.gradient


_TEMPORARY = re.compile(r"^\.node-(\d+)\.(safetensors|json)\.[0-9a-f]+\.tmp$")   # core.io's temporaries
_FINAL = re.compile(r"^node-(\d+)\.(safetensors|json)$")
_ROUND = re.compile(r"^round-(\d+)$")
_renaming = False     # the audit hook's own rename (json-written) is not a write point


def _round_of(folders: Iterable[str]) -> Optional[int]:
    """The round of the first checkpoint round folder (``round-NNNNNN``) among ``folders``."""
    for folder in folders:
        m = _ROUND.match(os.path.basename(folder))
        if m:
            return int(m.group(1))
    return None


def _open_folders() -> Iterator[str]:
    """What this process's descriptors point to: ``atomic_write_bytes`` opens the temporary's
    folder, then creates the temporary by name within it (the ``open`` event names no folder)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            yield os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue


def _audit(event: str, args: tuple) -> None:
    """SIGKILL this process at the planned point of a checkpoint write (:data:`POINTS`): the
    creation of the tensors' temporary ("tensors") or of the marker's ("tensors-written"), the
    rename of either ("tensors-renaming", "json-renaming"), or right after the marker's rename
    ("json-written": the hook renames it itself, then kills)."""
    global _renaming
    if event not in ("open", "os.rename"):
        return
    plan = _plan
    if plan is None or plan.kind != "ckpt" or _renaming:
        return
    if event == "open":
        path, _, flags = args
        m = _TEMPORARY.match(os.path.basename(path)) if isinstance(path, str) else None
        if m is None or int(m.group(1)) != plan.node or not isinstance(flags, int) or not flags & os.O_CREAT:
            return
        where = [os.path.dirname(os.path.abspath(path))] if os.path.dirname(path) else _open_folders()
        k = _round_of(where)
        if k is not None:
            plan.in_checkpoint(k, plan.node, "tensors" if m.group(2) == "safetensors" else "tensors-written")
        return
    src, dst, src_dir_fd, dst_dir_fd = args
    m = _FINAL.match(os.path.basename(dst)) if isinstance(dst, str) else None
    if m is None or int(m.group(1)) != plan.node:
        return
    try:
        if os.path.dirname(dst):
            folder = os.path.dirname(os.path.abspath(dst))
        else:
            folder = os.readlink(f"/proc/self/fd/{dst_dir_fd}") if dst_dir_fd >= 0 else os.getcwd()
    except OSError:      # not a folder this hook can name: not a checkpoint write
        return
    k = _round_of([folder])
    if k is None:
        return
    if m.group(2) == "safetensors":
        plan.in_checkpoint(k, plan.node, "tensors-renaming")
        return
    plan.in_checkpoint(k, plan.node, "json-renaming")
    if plan.kills_checkpoint(k, plan.node, "json-written"):
        _renaming = True
        fds = {key: fd for key, fd in (("src_dir_fd", src_dir_fd), ("dst_dir_fd", dst_dir_fd)) if fd >= 0}
        os.replace(src, dst, **fds)
        plan.in_checkpoint(k, plan.node, "json-written")
