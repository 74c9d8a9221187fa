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

The lock file is opened with ``O_NOFOLLOW`` and must be a plain file: a link, a FIFO or a folder
at its name is refused in one line naming it, and nothing is written through it. Every field of
a lock file is checked (:func:`parse_holder`): a malformed one written on this host, whose flock
nobody holds, is taken over with a note; one that names no host of ours is refused in one line
naming the file to remove. Callers pass real paths (the run's ``out`` is resolved), so two names
of one folder take one lock.

The file is removed when the lock is released. Processes are identified by PID and start time,
never by name.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import math
import os
import socket
import stat
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


# Bounds of a lock file's fields (a crafted file must not make a traceback, or a lock for good)
PID_MAX = 4_194_304          # Linux's PID_MAX_LIMIT
MAX_LOCK_BYTES = 4096        # a holder's JSON is about 150 bytes
MAX_FIELD_CHARS = 255        # a host name (HOST_NAME_MAX is 64), a job id, a start time


class MalformedLock(ValueError):
    """A lock file whose content is not a holder; the message says which field is wrong."""


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


def _text(d: dict, name: str, optional: bool) -> Optional[str]:
    v = d.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or len(v) > MAX_FIELD_CHARS or not v.isprintable():
        raise MalformedLock(f"its {name!r} is not a short printable string")
    return v


def parse_holder(raw: bytes) -> Holder:
    """The holder a lock file names; :class:`MalformedLock` says which field is wrong."""
    if len(raw) > MAX_LOCK_BYTES:
        raise MalformedLock(f"it holds {len(raw)} bytes, more than a lock's {MAX_LOCK_BYTES}")
    try:
        d = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise MalformedLock("it is not JSON") from None
    if not isinstance(d, dict):
        raise MalformedLock("it is not a JSON object")
    pid, since = d.get("pid"), d.get("since", 0.0)
    if not isinstance(pid, int) or isinstance(pid, bool) or not 1 <= pid <= PID_MAX:
        raise MalformedLock(f"its pid {str(pid)[:40]} is not a process id (1 to {PID_MAX})")
    if not isinstance(since, (int, float)) or isinstance(since, bool) or not math.isfinite(since) \
            or not 0 <= since < 2 ** 40:
        raise MalformedLock(f"its 'since' {str(since)[:40]} is not a time")
    start = _text(d, "start", optional=True)
    if start is not None and not start.isdigit():
        raise MalformedLock("its 'start' is not a process start time")
    return Holder(pid, _text(d, "host", optional=False), start, _text(d, "job", optional=True), float(since))


def _read(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while len(raw) <= MAX_LOCK_BYTES:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        raw += chunk
    return raw


def _host_of(raw: bytes) -> Optional[str]:
    """The host a malformed lock file still names well, if any."""
    try:
        d = json.loads(raw.decode("utf-8"))
        return _text(d, "host", optional=False) if isinstance(d, dict) else None
    except (ValueError, UnicodeDecodeError):
        return None


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a folder", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFLNK: "a symbolic link"}


def _open_lock(path: str, name: str, fix: str) -> int:
    """``path`` opened for the lock: created, or an existing plain file; never through a link."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = None
    try:
        fd = os.open(path, flags, 0o666 & ~current_umask())
        kind = _KINDS.get(stat.S_IFMT(os.fstat(fd).st_mode))
    except OSError:       # a link (ELOOP) or a folder (EISDIR) at the name: say which
        try:
            kind = _KINDS.get(stat.S_IFMT(os.lstat(path).st_mode))
        except OSError:
            kind = None
        if kind is None:
            raise
    if kind is None:
        return fd
    if fd is not None:
        os.close(fd)
    raise LockedError(f"{name}: its lock {path} is {kind}, not a lock file: nothing was written through "
                      f"it; remove it if no run is using it, or choose {fix}")


class OutputLock:
    """Locks on several paths, taken in order and released together (:meth:`release`)."""

    def __init__(self, paths: List[Tuple[str, str, str]]):
        """``paths``: (path, how a message names it, what to choose instead), e.g.
        ``("runs/x", "out=runs/x", "another out=")``; the lock file is ``<path>.lock``."""
        self.paths = [os.path.realpath(p) + ".lock" for p, _, _ in paths]
        self.what = {os.path.realpath(p) + ".lock": (name, fix) for p, name, fix in paths}
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
            fd = _open_lock(path, name, fix)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                raw = _read(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                try:
                    who = parse_holder(raw).describe()
                except MalformedLock:
                    who = "another process"
                raise LockedError(f"{name} is in use by a running job ({who}): wait for it to finish, "
                                  f"or choose {fix}") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if not same:            # released and removed under us: take the new file
                os.close(fd)
                continue
            try:
                me = Holder.me()
                self._judge(_read(fd), me, path, name, fix)
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
                os.write(fd, json.dumps(dataclasses.asdict(me)).encode())
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                raise
            self.fds[path] = fd
            return
        raise LockedError(f"{name}: its lock {path} keeps changing under this run: is another job "
                          f"starting into the same path? choose {fix}")

    def _judge(self, raw: bytes, me: Holder, path: str, name: str, fix: str) -> None:
        """A lock file whose flock nobody holds: empty (its holder died between create and write),
        stale, malformed, or held where flock cannot see."""
        if not raw.strip():
            return
        try:
            holder = parse_holder(raw)
        except MalformedLock as e:
            if _host_of(raw) == me.host:   # written here, and its flock is free: nobody holds it
                self.notes.append(f"{name}: took over a malformed lock file {path} ({e})")
                return
            raise LockedError(f"{name}: its lock file {path} is malformed ({e}) and names no process of this "
                              f"host: remove it if no run is using it, or choose {fix}") from None
        if holder.pid == me.pid and holder.host == me.host:
            return
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
                          f"{me.host}: wait for that job, or if no run is using it there, remove {path}; or "
                          f"choose {fix}")

    def release(self) -> None:
        for path, fd in list(self.fds.items()):
            try:
                os.unlink(path)     # still under our flock: nobody else can take it in between
            except OSError:
                pass
            os.close(fd)
            del self.fds[path]
