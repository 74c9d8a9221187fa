"""Timing several training loops step by step in rotation, in one process.

A benchmark that times its rows one after another lets load that shifts between the rows
move their ratio (on the shared 2-core machine two such runs of the x-step benchmark gave
TRL/ours 2.49 and 3.98). Here every row is a training loop that runs in its own thread and
hands the turn back after each optimizer step, so the rows take their steps in rotation
(row 1 step k, row 2 step k, ..., then step k + 1) and only one thread computes at a time.
A ratio of two rows is then also measured per rotation (:func:`paired_ratios`): the two
steps ran seconds apart under nearly the same load.

How a row works. The row's function ``fn(baton)`` runs in a daemon thread: it builds what
it needs (model, trainer, data), calls ``baton.ready()`` right before its first step and
``baton.step_done()`` right after every step (an optimizer step post-hook, a
``TrainerCallback.on_step_end``); each call hands the turn to the main thread and waits for
the next :meth:`Row.step`. A step's time is measured by the main thread, from handing the
turn over to getting it back (on CUDA after a ``torch.cuda.synchronize()``), so it covers
everything the loop does between two optimizer steps. The row's thread also records its own
CPU time over each step (``time.thread_time``: with one torch thread, forward, backward and
the optimizer all run on it): on a CPU shared with other work that figure hardly moves when
the machine gets busier, where the wall time does. After its last step a row is joined
(:meth:`Row.finish`) before the next row steps, so its clean-up overlaps nothing timed; what
``fn`` returns is the row's result.

GPU memory (CUDA only). Before every step the peak counter is reset; a row's peak is the
memory the row itself holds (what its build and its earlier steps left allocated: the
``torch.cuda.memory_allocated`` change over each of its own turns, summed) plus the step's
rise above what was allocated when it started. The other rows' models, resident in the same
process, are left out; ``process_peak`` keeps the raw ``max_memory_allocated``.

An error in a row is re-raised in the main thread as one RuntimeError naming the row; a
wait longer than ``timeout_s`` is one too. Remaining threads are released and end.
"""
from __future__ import annotations

import dataclasses
import queue
import statistics
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch


class Aborted(Exception):
    """Raised inside a row's thread when the rotation was abandoned."""


class Baton:
    """The turn between the main thread and one row's thread (the row's side: :meth:`ready`,
    :meth:`step_done`)."""

    def __init__(self, steps: int, timeout_s: float):
        self.steps, self.timeout_s = steps, timeout_s
        self.done = 0
        self.abort = False
        self.cpu_times: List[float] = []    # the row thread's CPU seconds of each step
        self._cpu0 = 0.0
        self._go = threading.Semaphore(0)
        self._back: "queue.Queue[tuple]" = queue.Queue()

    # the row's thread
    def ready(self) -> None:
        """Built, about to take the first step: wait for the turn."""
        self._back.put(("ready", None))
        self._wait()

    def step_done(self) -> None:
        """One optimizer step done: hand the turn back (and wait for the next, unless it was the last)."""
        self.cpu_times.append(time.thread_time() - self._cpu0)
        self.done += 1
        self._back.put(("step", None))
        if self.done < self.steps:
            self._wait()

    def _wait(self) -> None:
        if not self._go.acquire(timeout=self.timeout_s) or self.abort:
            raise Aborted("the rotation was abandoned")
        self._cpu0 = time.thread_time()

    # the main thread
    def release(self) -> None:
        self._go.release()

    def expect(self, name: str, what: str) -> None:
        try:
            kind, err = self._back.get(timeout=self.timeout_s)
        except queue.Empty:
            raise RuntimeError(f"{name}: no {what} within {self.timeout_s:.0f} s") from None
        if kind == "error":
            raise RuntimeError(f"{name} failed: {type(err).__name__}: "
                               f"{' '.join(str(err).split())[:300]}") from err
        if kind != what:
            raise RuntimeError(f"{name}: expected {what}, got {kind}")

    def fail(self, err: BaseException) -> None:
        self._back.put(("error", err))

    def end(self) -> None:
        self._back.put(("end", None))


@dataclasses.dataclass
class Row:
    """One training loop of the rotation, its step times and (on CUDA) memory figures."""

    name: str
    fn: Callable[[Baton], Any]
    steps: int
    timeout_s: float = 900.0
    times: List[float] = dataclasses.field(default_factory=list)
    peak_bytes: List[int] = dataclasses.field(default_factory=list)
    process_peak_bytes: List[int] = dataclasses.field(default_factory=list)
    resident_bytes: int = 0
    build_s: float = 0.0
    result: Any = None

    def __post_init__(self):
        self.baton = Baton(self.steps, self.timeout_s)
        self._thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        try:
            self.result = self.fn(self.baton)
            if self.baton.done != self.steps:
                raise RuntimeError(f"made {self.baton.done} steps, expected {self.steps}")
            self.baton.end()
        except Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.baton.fail(e)

    def start(self, cuda: bool) -> None:
        """Build the row (in its thread) up to its first step; the build's memory is the row's."""
        a0 = torch.cuda.memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name=f"bench-{self.name}", daemon=True)
        self._thread.start()
        self.baton.expect(self.name, "ready")
        self.build_s = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
            self.resident_bytes += torch.cuda.memory_allocated() - a0

    def step(self, cuda: bool) -> float:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            a0 = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        self.baton.release()
        self.baton.expect(self.name, "step")
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.times.append(dt)
        if cuda:
            peak = torch.cuda.max_memory_allocated()
            self.process_peak_bytes.append(peak)
            self.peak_bytes.append(self.resident_bytes + peak - a0)
            self.resident_bytes += torch.cuda.memory_allocated() - a0
        return dt

    def finish(self) -> Any:
        """Wait for the row's loop to end after its last step; its result."""
        self.baton.expect(self.name, "end")
        self._thread.join(self.timeout_s)
        return self.result

    def abandon(self) -> None:
        self.baton.abort = True
        self.baton.release()


def rotate(rows: Sequence[Row], *, cuda: bool = False, log: Callable[[str], None] = lambda m: None) -> None:
    """Build every row (one after another), then their steps in rotation; every row the same
    number of steps. Each row's ``times`` (and memory lists) get one entry per step."""
    n = {r.steps for r in rows}
    if len(n) != 1:
        raise ValueError(f"every row needs the same number of steps, got {sorted(n)}")
    steps = n.pop()
    try:
        for r in rows:
            log(f"# building {r.name} ...")
            r.start(cuda)
        for k in range(steps):
            for r in rows:
                r.step(cuda)
                if k == steps - 1:
                    r.finish()
            log(f"#   rotation {k + 1}/{steps}: " + ", ".join(f"{r.name} {r.times[-1]:.3f} s" for r in rows))
    except BaseException:
        for r in rows:
            r.abandon()
        raise


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> List[float]:
    """Per-rotation ratios ``num[k] / den[k]``."""
    if len(num) != len(den):
        raise ValueError(f"paired ratios need as many steps on both sides ({len(num)} != {len(den)})")
    return [a / b for a, b in zip(num, den)]


def summary(row: Row, warmup: int) -> Dict[str, Any]:
    """A row's timed steps (after ``warmup``), their median and, on CUDA, its peak memory."""
    timed, cpu = row.times[warmup:], row.baton.cpu_times[warmup:]
    out: Dict[str, Any] = {"median_s": statistics.median(timed), "step_times_s": timed,
                           "warmup_times_s": row.times[:warmup], "build_s": row.build_s,
                           "cpu_median_s": statistics.median(cpu), "cpu_step_times_s": cpu}
    if row.peak_bytes:
        out["peak_gib"] = max(row.peak_bytes[warmup:]) / 2 ** 30
        out["process_peak_gib"] = max(row.process_peak_bytes[warmup:]) / 2 ** 30
        out["resident_gib"] = row.resident_bytes / 2 ** 30
    return out
