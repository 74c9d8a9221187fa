"""A lock held on a run's output paths for as long as the run lives.

A lock is a small JSON file (``<path>.lock``) naming its holder (PID, host, the process's start
time, the torchrun run id or SLURM job) and an ``fcntl.flock`` on it, which the kernel drops when
the holder dies however it dies. Taking a lock:

- nobody holds it: take it;
- a live process holds it (the flock is taken, or the file names a live PID on this host):
  refused, naming the holder;
- the file names a process on this host that is gone (or whose PID now belongs to another
  process: the start time differs), or an earlier attempt of the same torchrun run / SLURM job:
  a stale lock, taken over, and the caller is told;
- the file names another host: that cannot be checked from here, so it is refused unless it is
  an earlier attempt of this job; the message says which file to remove if no run is using it.

The file is removed when the lock is released. Processes are identified by PID and start time,
never by name.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
from typing import Dict, List, Optional, Tuple

from admm_dist.core.errors import UserError
from admm_dist.core.io import current_umask


class LockedError(UserError):
    """Another live run holds the lock."""


def _start_time(pid: int) -> Optional[str]:
    """Field 22 of /proc/PID/stat (clock ticks since boot): with the PID it names one process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: Optional[str]) -> bool:
    now = _start_time(pid)
    if now is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True     # no /proc: a PID that exists is taken as the holder
    return start is None or now == start


def _job() -> Optional[str]:
    """The job this process belongs to: torchrun's run id (when named) or SLURM's job id."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{os.environ['SLURM_JOB_ID']}"
    return None


@dataclasses.dataclass
class Holder:
    pid: int
    host: str
    start: Optional[str]
    job: Optional[str]
    since: float

    @classmethod
    def me(cls) -> "Holder":
        pid = os.getpid()
        return cls(pid, socket.gethostname(), _start_time(pid), _job(), time.time())

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host} (since {when}{', job ' + self.job if self.job else ''})"


def _read(fd: int) -> Optional[Holder]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        raw += chunk
    try:
        d = json.loads(raw.decode("utf-8"))
        return Holder(int(d["pid"]), str(d["host"]), d.get("start"), d.get("job"), float(d.get("since", 0)))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None      # empty (a holder died between create and write) or garbage: nobody


class OutputLock:
    """Locks on several paths, taken in order and released together (:meth:`release`)."""

    def __init__(self, paths: List[Tuple[str, str, str]]):
        """``paths``: (path, how a message names it, what to choose instead), e.g.
        ``("runs/x", "out=runs/x", "another out=")``; the lock file is ``<path>.lock``."""
        self.paths = [os.path.abspath(p) + ".lock" for p, _, _ in paths]
        self.what = {os.path.abspath(p) + ".lock": (name, fix) for p, name, fix in paths}
        self.fds: Dict[str, int] = {}
        self.notes: List[str] = []  # stale locks taken over, for the caller to say

    def acquire(self) -> "OutputLock":
        try:
            for path in self.paths:
                self._take(path)
        except BaseException:
            self.release()
            raise
        return self

    def _take(self, path: str) -> None:
        name, fix = self.what[path]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        for _ in range(5):          # the file may be replaced between open and flock: retry
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666 & ~current_umask())
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                who = holder.describe() if holder else "another process"
                raise LockedError(f"{name} is in use by a running job ({who}): wait for it to finish, "
                                  f"or choose {fix}") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:            # released and removed under us: take the new file
                os.close(fd)
                continue
            holder = _read(fd)
            me = Holder.me()
            if holder is not None and holder.pid != me.pid:
                self._judge(holder, me, path, name, fix)
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps(dataclasses.asdict(me)).encode())
            os.fsync(fd)
            self.fds[path] = fd
            return
        raise LockedError(f"{name}: its lock {path} keeps changing under this run: is another job "
                          f"starting into the same path? choose {fix}")

    def _judge(self, holder: Holder, me: Holder, path: str, name: str, fix: str) -> None:
        """A lock file whose flock nobody holds: stale, or held where flock cannot see."""
        if holder.job is not None and holder.job == me.job:
            self.notes.append(f"{name}: took over the lock of an earlier attempt of this job "
                              f"({holder.describe()})")
            return
        if holder.host == me.host:
            if _alive(holder.pid, holder.start):
                raise LockedError(f"{name} is in use by a running job ({holder.describe()}): wait for it "
                                  f"to finish, or choose {fix}")
            self.notes.append(f"{name}: took over a stale lock ({holder.describe()} is no longer running)")
            return
        raise LockedError(f"{name} is locked by {holder.describe()}, which cannot be checked from host "
                          f"{me.host}: wait for that job, or if no run is using it there, remove {path}; or choose {fix}")

    def release(self) -> None:
        for path, fd in list(self.fds.items()):
            try:
                os.unlink(path)     # still under our flock: nobody else can take it in between
            except OSError:
                pass
            os.close(fd)
            del self.fds[path]
