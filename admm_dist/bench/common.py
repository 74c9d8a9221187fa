"""What the benchmarks share: the machine's load and CPU accounting, and the run's footer.

- :class:`CpuClock` reads the CPU time of every task on the machine (``/proc/stat``) and this
  process's own (itself and its waited-for children); :func:`other_cores` turns two readings
  into the mean number of cores other processes kept busy, and :class:`CpuWindow` takes the
  readings around a stretch of work.
- :func:`loadavg` and :func:`load_str` are the 1-minute and the 1/5/15-minute load averages.
- :func:`load_footer` is the closing line of ``xstep`` and ``collect``; :func:`write_json`
  writes a benchmark's JSON summary atomically and says so; :func:`hush_future_warnings`
  keeps the libraries' deprecation chatter out of the tables.
- :class:`Column` and :func:`format_rows` print a table of records: a header, a rule, then a
  line per record, every cell right- or left-aligned to its column's width (``comm`` and
  ``placement`` use them); :func:`num` writes a number, or n/a for a missing one.
"""
from __future__ import annotations

import dataclasses
import os
import resource
import time
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple


class CpuClock:
    """CPU time of all tasks on the machine (``/proc/stat``) and our own (self + waited-for children)."""

    @staticmethod
    def machine_busy_s() -> Optional[float]:
        """user + nice + system of every CPU; interrupt, softirq and steal time are left out."""
        try:
            with open("/proc/stat") as fh:
                fields = fh.readline().split()
            user, nice, system = (int(x) for x in fields[1:4])
        except (OSError, ValueError):
            return None
        return (user + nice + system) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def own_s() -> float:
        s = resource.getrusage(resource.RUSAGE_SELF)
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def other_cores(busy0: Optional[float], busy1: Optional[float], own_s: float,
                wall_s: float) -> Optional[float]:
    """Mean number of cores that processes other than ours kept busy over ``wall_s``."""
    if busy0 is None or busy1 is None or wall_s <= 0:
        return None
    return max(0.0, (busy1 - busy0) - own_s) / wall_s


@dataclasses.dataclass(frozen=True)
class CpuWindow:
    """The readings at the start of a stretch of work; :meth:`stop` gives its wall time and
    the cores other processes used meanwhile."""

    busy0: Optional[float]
    own0: float
    t0: float

    @classmethod
    def start(cls) -> "CpuWindow":
        return cls(CpuClock.machine_busy_s(), CpuClock.own_s(), time.perf_counter())

    def stop(self) -> Tuple[float, Optional[float]]:
        """(wall seconds since :meth:`start`, mean cores used by other processes over them)."""
        wall = time.perf_counter() - self.t0
        return wall, other_cores(self.busy0, CpuClock.machine_busy_s(), CpuClock.own_s() - self.own0, wall)


def loadavg() -> Optional[float]:
    """The 1-minute load average, or None where the system does not tell."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def load_str() -> str:
    """The 1/5/15-minute load averages as ``a/b/c``, or ``n/a``."""
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def load_footer(r: Mapping[str, Any], *, missing: str) -> str:
    """The closing line: load before/after, other processes' cores (``missing`` when unknown), wall."""
    other = r["other_processes_cores"]
    return (f"# load average 1 min before/after: {r['loadavg_1min_before']}/{r['loadavg_1min_after']}; "
            f"other processes used about {missing if other is None else format(other, '.2f')} cores; "
            f"wall {r['wall_s']:.1f} s")


def write_json(path: str, data: Any, message: Optional[str] = None) -> None:
    """Write ``data`` to ``path`` atomically, then print ``message`` (default ``# wrote PATH``)."""
    from admm_dist.core.io import atomic_write_json

    atomic_write_json(path, data)
    print(f"# wrote {path}" if message is None else message)


def hush_future_warnings() -> None:
    """Keep the libraries' deprecation chatter (e.g. transformers' is_gradient_checkpointing,
    read by PEFT) out of the table."""
    warnings.filterwarnings("ignore", category=FutureWarning)


def descendants(pid: int) -> List[int]:
    """Live descendants of ``pid`` (by PID, from /proc; torchrun starts its workers in their own
    sessions, so a process group would not reach them)."""
    kids: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of :func:`format_rows`: its header, width (0: as wide as its text), alignment
    (``>`` or ``<``), how a record becomes the cell's text, and the space before it."""
    header: str
    width: int
    cell: Callable[[Mapping[str, Any]], str]
    align: str = ">"
    sep: str = " "


def num(x: Optional[float], spec: str) -> str:
    """``x`` formatted with ``spec``, or n/a when it is missing."""
    return "n/a" if x is None else format(x, spec)


def format_rows(columns: Sequence[Column], records: Sequence[Mapping[str, Any]]) -> List[str]:
    """The header, a rule as long as it, and one line per record."""
    def line(cells: Sequence[str]) -> str:
        return "".join((col.sep if i else "") + format(c, f"{col.align}{col.width}" if col.width else "")
                       for i, (col, c) in enumerate(zip(columns, cells)))

    head = line([c.header for c in columns])
    return [head, "-" * len(head)] + [line([c.cell(r) for c in columns]) for r in records]
