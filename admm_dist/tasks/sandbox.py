"""Run untrusted Python (model-written code and its tests) in a sandbox that contains it.

:func:`run_python` writes the code to a fresh temporary directory and runs ``python -I`` on
it under bubblewrap (``bwrap``), with stdin closed, stdout and stderr going to files (a
chatty program is cut by the file-size limit instead of filling the caller's memory) and a
wall-clock timeout. It never raises for what the code does; it reports it. Inside:

- its own PID namespace (when its PID 1 exits, the kernel kills everything in it, so a
  ``setsid`` child dies too; ``/proc`` shows only the sandbox; no host process can be
  signalled), no network (a new network namespace with only its own loopback), its own IPC
  and UTS namespaces, a new session. PID 1 is bwrap's init when bwrap runs as root (it runs
  as root there, out of the program's reach), else the program itself, since a bwrap init
  would share its uid without the seccomp filter and could be ptraced;
- a filesystem of its own: ``/usr`` (and the ``/bin``, ``/lib*`` links), the Python in use
  (``sys.prefix``, ``sys.base_prefix``, whole) and a few harmless ``/etc`` files, all read-only;
  the folders above a prefix only as the way down to it (a venv inside the clone: the clone's
  folder holding ``.venv`` alone); a made-up ``/etc/passwd``; fresh ``/dev`` and ``/proc``;
  nothing else of the host (no ``/root``, ``/home``, ``/work``, host ``/tmp``, ``/etc/passwd``,
  sockets, the clone's own files). Writable: only a private tmpfs ``/tmp`` of :data:`TMPFS_MB`
  holding the working folder, and ``/dev/shm``;
- an empty environment plus a minimal one; no capabilities, ``no_new_privs``, and a seccomp
  filter against new namespaces, mounts, AF_VSOCK and memory outside the limits
  (:mod:`admm_dist.tasks.bubblewrap` builds the command line and the filter);
- an unprivileged uid/gid, so the kernel's per-user process limit (:data:`NPROC` tasks)
  holds: as root, bwrap sets the sandbox up without a user namespace (one would map the
  sandbox to host root, which the process limit exempts) and the program drops, before it
  starts, to a uid of its own run (:func:`~admm_dist.tasks.bubblewrap.sandbox_uid`: concurrent
  sandboxes never share the budget); as another user, a user namespace makes it
  :data:`SANDBOX_UID`;
- resource limits: address space (``memory_mb``), CPU seconds, written-file size, open
  files, no core dumps.

Isolation is probed once (a real run of a tiny program) and cached. Where it is not
available the code is refused (:class:`SandboxUnavailable`) unless the caller opts in to
resource limits only (``allow_unisolated=True`` or ``ADMM_SANDBOX=unisolated``); never as
root. :func:`describe` says in one line which isolation is in force. See docs/sandbox.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Dict, Optional, Tuple

from admm_dist.core.errors import RunError
from admm_dist.tasks.bubblewrap import (
    NPROC,
    SANDBOX_GID,
    SANDBOX_UID,
    SHM_MB,
    TMPFS_MB,
    bwrap_argv,
    minimal_env,
    pid1_fd,
    sandbox_uid,
    seccomp_filter,
    write_etc,
)

TAIL_CHARS = 2000
FSIZE_MB = 16
NOFILE = 512         # open files: bounds what pipes and socket buffers can hold
ENV_VAR = "ADMM_SANDBOX"            # "unisolated": allow resource limits only where no isolation
BWRAP: Optional[str] = None         # the bwrap to use; None: ``bwrap`` on PATH, else /usr/bin/bwrap
ISOLATED, UNISOLATED = "bwrap", "rlimits-only"
INSTALL = "install bubblewrap (apt-get install bubblewrap)"


class SandboxUnavailable(RunError, OSError):
    """No sandbox can contain untrusted code here and running it uncontained is not allowed.

    The message is one line naming the fix. (An OSError too, so command-line tools report it
    as one line of bad environment rather than a traceback.)"""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    ok: bool  # exited 0 within the time limit
    # negative: killed by that signal (the timeout); under bwrap a program killed by signal N
    # inside reports 128 + N, as in a shell; None: never started
    returncode: Optional[int]
    timed_out: bool
    stdout_tail: str
    stderr_tail: str
    isolation: str  # what contained it: ISOLATED ("bwrap") or UNISOLATED ("rlimits-only")


# --------------------------------------------------------------------------- policy
_probed: Dict[Tuple[str, int], Optional[str]] = {}
_probe_lock = threading.Lock()


def _bwrap_path(bwrap: Optional[str]) -> Optional[str]:
    """The bwrap asked for (argument, then :data:`BWRAP`), else the one on PATH; None: none."""
    want = bwrap or BWRAP
    if want:
        return want if os.path.isfile(want) and os.access(want, os.X_OK) else None
    found = shutil.which("bwrap")
    return found or ("/usr/bin/bwrap" if os.access("/usr/bin/bwrap", os.X_OK) else None)


def _probe(path: str) -> Optional[str]:
    """None if ``path`` starts a sandbox here whose program runs as the sandbox uid, else why
    not (one line). Run once per bwrap and caller uid, then cached."""
    key = (path, os.geteuid())
    with _probe_lock:
        if key not in _probed:
            r = _run("import os\nprint(*os.getresuid(), *os.getresgid())\n", 20.0, 256, path)
            want = " ".join([str(sandbox_uid())] * 3 + [str(SANDBOX_GID)] * 3)  # this thread's
            if r.ok and r.stdout_tail.strip() == want:
                _probed[key] = None
            else:
                lines = [ln.strip() for ln in r.stderr_tail.splitlines() if ln.strip()]
                why = lines[-1] if lines else (f"it ran as {r.stdout_tail.strip()!r}, not {want!r}"
                                               if r.ok else f"exit status {r.returncode}")
                _probed[key] = f"bwrap at {path} cannot start a sandbox here ({why})"
        return _probed[key]


def _opted_in(allow_unisolated: Optional[bool]) -> bool:
    if allow_unisolated is not None:
        return bool(allow_unisolated)
    value = os.environ.get(ENV_VAR, "").strip()
    if value not in ("", "unisolated"):
        raise SandboxUnavailable(f"{ENV_VAR}={value!r}: set it to 'unisolated' (resource limits "
                                 f"only where no sandbox is available) or leave it unset")
    return value == "unisolated"


def _why_not_isolated(bwrap: Optional[str]) -> Optional[str]:
    path = _bwrap_path(bwrap)
    if path is None:
        return (f"no bubblewrap at {bwrap or BWRAP}" if (bwrap or BWRAP)
                else "no bubblewrap (bwrap) on PATH or at /usr/bin/bwrap")
    return _probe(path)


def isolation(allow_unisolated: Optional[bool] = None, bwrap: Optional[str] = None) -> str:
    """The isolation :func:`run_python` uses: ``"bwrap"``, or ``"rlimits-only"`` where there is
    none and the caller opted in (``allow_unisolated``, else ``ADMM_SANDBOX=unisolated``).

    Raises :class:`SandboxUnavailable` where it would refuse: no working bwrap and no opt-in,
    or no working bwrap and the caller is root (never run uncontained as root)."""
    opted = _opted_in(allow_unisolated)  # a bad ADMM_SANDBOX value is an error even where bwrap works
    why = _why_not_isolated(bwrap)
    if why is None:
        return ISOLATED
    if os.geteuid() == 0:
        raise SandboxUnavailable(f"{why}, and untrusted code is never run as root without a sandbox: "
                                 f"{INSTALL} or run as an unprivileged user")
    if not opted:
        raise SandboxUnavailable(f"{why}: {INSTALL}, or set {ENV_VAR}=unisolated (allow_unisolated=True) "
                                 f"to run untrusted code with resource limits only")
    return UNISOLATED


def isolation_available(bwrap: Optional[str] = None) -> bool:
    """Does bwrap start a working sandbox here (probed once)?"""
    return _why_not_isolated(bwrap) is None


def describe(allow_unisolated: Optional[bool] = None, bwrap: Optional[str] = None) -> str:
    """One line saying which isolation untrusted code gets here (never raises)."""
    try:
        mode = isolation(allow_unisolated, bwrap)
    except SandboxUnavailable as exc:
        return f"code sandbox: unavailable: {exc}"
    if mode == ISOLATED:
        uid = "a uid per run" if os.geteuid() == 0 else f"uid {SANDBOX_UID}"
        return (f"code sandbox: bwrap ({_bwrap_path(bwrap)}): own PID, network and IPC namespaces, "
                f"read-only system and Python, no host files, {uid}, at most {NPROC} tasks, "
                f"{TMPFS_MB} + {SHM_MB} MiB writable, "
                + ("seccomp filter" if seccomp_filter() else f"no seccomp filter on {os.uname().machine}"))
    return (f"code sandbox: resource limits only ({_why_not_isolated(bwrap)}; opted in): untrusted code "
            f"runs as uid {os.geteuid()} and can read your files and use the network")


# --------------------------------------------------------------------------- running
# Sets the resource limits, then execs the command (argv[2:]) in the same process. It runs as a
# program of its own rather than as a preexec_fn: Python code between fork and exec can deadlock
# on a lock another thread held at the fork, and two sandboxes started from two threads did.
_WITH_LIMITS = (
    "import os, resource, sys\n"
    "mem, cpu, fsize, nofile, nproc = map(int, sys.argv[1].split(','))\n"
    "for what, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_CORE, 0),\n"
    "                    (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, nofile)):\n"
    "    resource.setrlimit(what, (value, value))\n"
    "if nproc:  # per-user count; lowering it may be refused or meaningless (root): best effort\n"
    "    try:\n"
    "        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))\n"
    "    except (ValueError, OSError):\n"
    "        pass\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")


def _with_limits(argv, memory_mb: int, cpu_s: int, nproc: bool) -> list:
    """``argv`` run under the sandbox's resource limits (address space, CPU seconds, written-file
    size, open files, no core dumps, and the task count where ``nproc``)."""
    limits = f"{int(memory_mb) << 20},{cpu_s},{FSIZE_MB << 20},{NOFILE},{NPROC if nproc else 0}"
    return [sys.executable, "-I", "-S", "-c", _WITH_LIMITS, limits, *argv]


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4 * TAIL_CHARS))
            return f.read().decode("utf-8", "replace")[-TAIL_CHARS:]
    except OSError:
        return ""


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run(code: str, timeout_s: float, memory_mb: int, bwrap: Optional[str]) -> SandboxResult:
    """Run ``code`` under bwrap at ``bwrap``, or with rlimits only where ``bwrap`` is None."""
    mode = ISOLATED if bwrap else UNISOLATED
    with tempfile.TemporaryDirectory(prefix="admm_sandbox_", ignore_cleanup_errors=True) as tmp, \
            contextlib.ExitStack() as files:
        script, out, err = (os.path.join(tmp, f) for f in ("main.py", "stdout.txt", "stderr.txt"))
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        cpu_s = max(1, math.ceil(timeout_s)) + 1
        work = "/tmp/" + os.path.basename(tmp)  # inside: the same name, on the private tmpfs
        pid1 = None
        try:
            fo, fe, fm = (files.enter_context(open(p, m)) for p, m in
                          ((out, "wb"), (err, "wb"), (script, "rb")))
            if bwrap:
                write_etc(tmp, work)
                bpf, seccomp_fd = seccomp_filter(), None
                if bpf is not None:
                    with open(os.path.join(tmp, "seccomp.bpf"), "wb") as f:
                        f.write(bpf)
                    seccomp_fd = files.enter_context(open(f.name, "rb")).fileno()
                info_r, info_w = os.pipe()  # where bwrap says the host pid of its PID 1
                files.callback(os.close, info_r)
                try:
                    proc = subprocess.Popen(
                        _with_limits(bwrap_argv(bwrap, tmp, work, fm.fileno(), seccomp_fd, info_w),
                                     memory_mb, cpu_s, nproc=False), cwd="/",
                        env=minimal_env(work, "/tmp"),  # bwrap's own environment: nothing of the caller's
                        stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, close_fds=True,
                        pass_fds=tuple(fd for fd in (fm.fileno(), seccomp_fd, info_w) if fd is not None),
                        start_new_session=True)
                finally:
                    os.close(info_w)
                pid1 = pid1_fd(info_r, proc)
                if pid1 is not None:
                    files.callback(os.close, pid1)
            else:
                proc = subprocess.Popen(
                    _with_limits([sys.executable, "-I", "main.py"], memory_mb, cpu_s, nproc=True),
                    cwd=tmp, env=minimal_env(tmp, tmp),
                    stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, close_fds=True,
                    start_new_session=True)
        except OSError as e:
            return SandboxResult(False, None, False, "", f"sandbox could not start python: {e}", mode)
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out, rc = True, -signal.SIGKILL
            if pid1 is not None:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(pid1, signal.SIGKILL)
            _kill_group(proc.pid)  # bwrap, and (--die-with-parent) its PID 1: all inside goes
            proc.wait()
        if pid1 is not None:  # bwrap may exit first: wait until its PID namespace is empty
            done = select.poll()
            done.register(pid1, select.POLLIN)
            done.poll(10_000)
        elif not bwrap:  # whatever the code left running in its session
            _kill_group(proc.pid)
        return SandboxResult(rc == 0 and not timed_out, rc, timed_out, _tail(out), _tail(err), mode)


def run_python(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512,
               allow_unisolated: Optional[bool] = None, bwrap: Optional[str] = None) -> SandboxResult:
    """Run ``code`` as a script in the sandbox; ok means exit status 0 in time.

    ``result.isolation`` says what contained it. Raises :class:`SandboxUnavailable` (one line
    naming the fix) where no sandbox works and resource limits alone are not allowed: see
    :func:`isolation`. ``bwrap`` picks the bwrap binary (default :data:`BWRAP`, else PATH)."""
    mode = isolation(allow_unisolated, bwrap)
    return _run(code, timeout_s, memory_mb, _bwrap_path(bwrap) if mode == ISOLATED else None)
