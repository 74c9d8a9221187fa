"""Run untrusted Python (model-written code and its tests) in a limited separate process.

:func:`run_python` writes the code to a fresh temporary directory and runs ``python -I``
(isolated: no user site, no ``PYTHON*`` variables) there, in its own session, with stdin
closed, a minimal environment and resource limits set before ``exec``: address space
(``memory_mb``), CPU seconds, written-file size, process count (where the system allows),
no core dumps. stdout and stderr go to files in that directory, so a chatty program is cut
by the file-size limit instead of filling the caller's memory. A wall-clock timeout kills
the whole process group. It never raises for what the code does; it reports it.

This is a guard against accidents (loops, memory bombs, stray files), not a security
boundary against a determined attacker: the code runs as the caller's user.
"""
from __future__ import annotations

import dataclasses
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
from typing import Optional

TAIL_CHARS = 2000
FSIZE_MB = 16
NPROC = 256


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    ok: bool  # exited 0 within the time limit
    returncode: Optional[int]  # negative: killed by that signal; None: never started
    timed_out: bool
    stdout_tail: str
    stderr_tail: str


def _limits(memory_mb: int, cpu_s: int):
    """The preexec_fn: only setrlimit calls, set in the child between fork and exec."""
    def apply() -> None:
        mem = int(memory_mb) << 20
        for what, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu_s),
                            (resource.RLIMIT_FSIZE, FSIZE_MB << 20), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(what, (value, value))
        try:  # per-user count; lowering it may be refused or meaningless (root), so best effort
            resource.setrlimit(resource.RLIMIT_NPROC, (NPROC, NPROC))
        except (ValueError, OSError):
            pass
    return apply


def _env(tmp: str) -> dict:
    one = "1"  # one thread per numeric library, so imports fit the address-space limit
    return {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": one, "OPENBLAS_NUM_THREADS": one,
            "MKL_NUM_THREADS": one}


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


def run_python(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512) -> SandboxResult:
    """Run ``code`` as a script under the limits above; ok means exit status 0 in time."""
    with tempfile.TemporaryDirectory(prefix="admm_sandbox_", ignore_cleanup_errors=True) as tmp:
        script, out, err = (os.path.join(tmp, f) for f in ("main.py", "stdout.txt", "stderr.txt"))
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        timed_out = False
        try:
            with open(out, "wb") as fo, open(err, "wb") as fe:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "main.py"], cwd=tmp, env=_env(tmp),
                    stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, close_fds=True,
                    start_new_session=True,
                    preexec_fn=_limits(memory_mb, max(1, math.ceil(timeout_s)) + 1))
        except OSError as e:
            return SandboxResult(False, None, False, "", f"sandbox could not start python: {e}")
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            rc = proc.wait()
        _kill_group(proc.pid)  # whatever the code left running in its session
        return SandboxResult(rc == 0 and not timed_out, rc, timed_out, _tail(out), _tail(err))
