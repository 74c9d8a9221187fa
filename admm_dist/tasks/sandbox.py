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
  (``sys.prefix``, ``sys.base_prefix``) and a few harmless ``/etc`` files, all read-only; a
  made-up ``/etc/passwd``; fresh ``/dev`` and ``/proc``; nothing else of the host (no
  ``/root``, ``/home``, ``/work``, host ``/tmp``, ``/etc/passwd``, sockets). Writable: only a
  private tmpfs ``/tmp`` of :data:`TMPFS_MB` holding the working folder, and ``/dev/shm``;
- an empty environment plus a minimal one; no capabilities, ``no_new_privs``, and a seccomp
  filter against new namespaces, mounts, AF_VSOCK and memory outside the limits (_DENY);
- an unprivileged uid/gid (:data:`SANDBOX_UID`), so the kernel's per-user process limit
  (:data:`NPROC` tasks) holds: as root, bwrap sets the sandbox up without a user namespace
  (one would map the sandbox to host root, which the process limit exempts) and the program
  drops to that uid before it starts; as another user, a user namespace does it;
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
import errno
import json
import math
import os
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

TAIL_CHARS = 2000
FSIZE_MB = 16
NPROC = 256          # tasks (processes and threads) the sandbox user may have
NOFILE = 512         # open files: bounds what pipes and socket buffers can hold
TMPFS_MB = 64        # what the code can write to /tmp and its working folder there, together
SHM_MB = 16          # and to /dev/shm (POSIX shared memory, multiprocessing's semaphores)
SANDBOX_UID = SANDBOX_GID = 65534   # nobody / nogroup
ENV_VAR = "ADMM_SANDBOX"            # "unisolated": allow resource limits only where no isolation
BWRAP: Optional[str] = None         # the bwrap to use; None: ``bwrap`` on PATH, else /usr/bin/bwrap
ISOLATED, UNISOLATED = "bwrap", "rlimits-only"
INSTALL = "install bubblewrap (apt-get install bubblewrap)"

# Run inside the sandbox before the program: the per-sandbox task limit, and, when bwrap ran
# as root (no user namespace), the drop to the sandbox uid/gid. exec keeps the limits.
_BOOT = ("import os, resource, sys\n"
         "uid, gid, nproc = map(int, sys.argv[1:4])\n"
         "hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]\n"
         "nproc = nproc if hard == resource.RLIM_INFINITY else min(nproc, hard)\n"
         "resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))\n"
         "if os.getuid() == 0:\n"
         "    os.setgroups([]); os.setgid(gid); os.setuid(uid)\n"
         "if 0 in os.getresuid() or 0 in os.getresgid():\n"
         "    sys.exit('sandbox: could not drop root')\n"
         "os.execv(sys.executable, [sys.executable, '-I', 'main.py'])\n")
# The seccomp filter (x86_64 and aarch64): system calls the code never needs that would widen
# the kernel's surface or reach past the sandbox. Refused with EPERM: new namespaces (so no
# nested user namespace, in which the code could mount an unbounded tmpfs), mounts, keyrings,
# bpf, perf, userfaultfd, io_uring, SysV shared memory and message queues (memory outside the
# limits), an AF_VSOCK socket (a VM's channel to its host). With ENOSYS (callers fall back):
# clone3 (whose flags a filter cannot read) and memfd_create (memory outside the tmpfs caps).
_DENY = {  # name: (x86_64, aarch64)
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "chroot": (161, 51), "add_key": (248, 217), "request_key": (249, 218),
    "keyctl": (250, 219), "perf_event_open": (298, 241), "bpf": (321, 280), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "shmget": (29, 194), "msgget": (68, 186)}
_NOSYS = {"clone3": (435, 435), "memfd_create": (319, 279)}
_CLONE, _SOCKET = (56, 220), (41, 198)
_CLONE_NEW = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_AF_VSOCK = 40
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives")
_ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


class SandboxUnavailable(RuntimeError, OSError):
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
            want = " ".join([str(SANDBOX_UID)] * 3 + [str(SANDBOX_GID)] * 3)
            if r.ok and r.stdout_tail.strip() == want:
                _probed[key] = None
            else:
                lines = [ln.strip() for ln in r.stderr_tail.splitlines() if ln.strip()]
                why = lines[-1] if lines else (f"it ran as {r.stdout_tail.strip()!r}, not uid "
                                               f"{SANDBOX_UID}" if r.ok else f"exit status {r.returncode}")
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
        return (f"code sandbox: bwrap ({_bwrap_path(bwrap)}): own PID, network and IPC namespaces, "
                f"read-only system and Python, no host files, uid {SANDBOX_UID}, at most {NPROC} tasks, "
                f"{TMPFS_MB} + {SHM_MB} MiB writable, "
                + ("seccomp filter" if _seccomp_filter() else f"no seccomp filter on {os.uname().machine}"))
    return (f"code sandbox: resource limits only ({_why_not_isolated(bwrap)}; opted in): untrusted code "
            f"runs as uid {os.geteuid()} and can read your files and use the network")


# --------------------------------------------------------------------------- running
def _limits(memory_mb: int, cpu_s: int, nproc: bool):
    """The preexec_fn: only setrlimit calls, set in the child between fork and exec."""
    def apply() -> None:
        mem = int(memory_mb) << 20
        for what, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu_s),
                            (resource.RLIMIT_FSIZE, FSIZE_MB << 20), (resource.RLIMIT_CORE, 0),
                            (resource.RLIMIT_NOFILE, NOFILE)):
            resource.setrlimit(what, (value, value))
        if nproc:  # per-user count; lowering it may be refused or meaningless (root): best effort
            try:
                resource.setrlimit(resource.RLIMIT_NPROC, (NPROC, NPROC))
            except (ValueError, OSError):
                pass
    return apply


def _env(home: str, tmp: str) -> dict:
    one = "1"  # one thread per numeric library, so imports fit the address-space limit
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8",
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


def _pid1(info_r: int, proc: subprocess.Popen) -> Optional[int]:
    """A pidfd for bwrap's PID 1, from the JSON bwrap writes to ``info_r`` as it starts; its
    exit means the kernel has killed everything in the PID namespace. None where that fails
    (then bwrap exiting is all there is to wait for)."""
    data, deadline = b"", time.monotonic() + 10.0
    ready = select.poll()  # not select.select: the caller may hold more than 1024 files
    ready.register(info_r, select.POLLIN)
    while b"}" not in data and time.monotonic() < deadline:
        if ready.poll(50):
            chunk = os.read(info_r, 4096)
            if not chunk:
                break
            data += chunk
        elif proc.poll() is not None:
            break
    try:
        child = int(json.loads(data)["child-pid"])
        fd = os.pidfd_open(child)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    try:  # still bwrap's child? (else the number was freed and reused: not ours to wait on)
        with open(f"/proc/{child}/stat") as f:
            ours = int(f.read().rsplit(")", 1)[1].split()[1]) == proc.pid
    except (OSError, ValueError, IndexError):
        ours = True  # gone already: the pidfd reads as exited
    if not ours:
        os.close(fd)
        return None
    return fd


def _python_dirs() -> List[str]:
    """The folders the running Python needs (prefixes, the interpreter's own), outside /usr."""
    dirs: List[str] = []
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))):
        for q in {os.path.abspath(p), os.path.realpath(p)}:
            if q not in dirs:
                dirs.append(q)
    keep = []
    for d in sorted(dirs, key=len):
        if d != "/" and not any(d == k or d.startswith(k.rstrip("/") + "/") for k in keep + ["/usr"]):
            keep.append(d)
    return keep


def _ancestors(path: str) -> List[str]:
    out, p = [], os.path.dirname(path)
    while p not in ("/", ""):
        out.append(p)
        p = os.path.dirname(p)
    return out[::-1]


def _seccomp_filter() -> Optional[bytes]:
    """The classic-BPF program for bwrap's ``--seccomp`` (see _DENY); None on other machines."""
    arch = {"x86_64": 0, "amd64": 0, "aarch64": 1, "arm64": 1}.get(os.uname().machine)
    if arch is None or struct.calcsize("P") != 8 or sys.byteorder != "little":
        return None
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, JMP|JEQ/JGE/JSET|K, RET|K
    allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
    prog: List[tuple] = []   # (code, k, jump-if-true label, jump-if-false label)
    labels: Dict[str, int] = {}
    prog += [(ld, 4, None, None), (jeq, (0xC000003E, 0xC00000B7)[arch], None, "kill"),
             (ld, 0, None, None)]  # seccomp_data.arch, then .nr
    if arch == 0:
        prog.append((jge, 0x40000000, "eperm", None))  # the x32 ABI's numbers
    prog += [(jeq, nrs[arch], "eperm", None) for nrs in _DENY.values()]
    prog += [(jeq, nrs[arch], "enosys", None) for nrs in _NOSYS.values()]
    prog += [(jeq, _CLONE[arch], "clone", None), (jeq, _SOCKET[arch], "socket", None),
             (ret, allow, None, None)]
    for name, body in (("clone", [(ld, 16, None, None), (jset, _CLONE_NEW, "eperm", None)]),
                       ("socket", [(ld, 16, None, None), (jeq, _AF_VSOCK, "eperm", None)])):
        labels[name] = len(prog)   # args[0], low 32 bits: the flags, the address family
        prog += body + [(ret, allow, None, None)]
    for name, value in (("eperm", 0x00050000 | errno.EPERM), ("enosys", 0x00050000 | errno.ENOSYS),
                        ("kill", kill)):
        labels[name] = len(prog)
        prog.append((ret, value, None, None))
    out = b""
    for i, (code, k, jt, jf) in enumerate(prog):
        jt, jf = ((labels[x] - i - 1) if x else 0 for x in (jt, jf))
        out += struct.pack("=HBBI", code, jt, jf, k)
    return out


def _bwrap_argv(bwrap: str, host: str, work: str, main_fd: int, seccomp_fd: Optional[int],
                info_fd: int) -> List[str]:
    root = os.geteuid() == 0
    argv = [bwrap, "--info-fd", str(info_fd), "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--hostname", "sandbox"]
    if root:  # no user namespace: it would map the sandbox to host root (exempt from NPROC)
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # --as-pid-1: bwrap's own PID 1 would share the program's uid, unfiltered by seccomp,
        # and the program could ptrace it; so the program is PID 1 (its exit still ends all)
        argv += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID),
                 "--cap-drop", "ALL", "--as-pid-1"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += ["--ro-bind", "/usr", "/usr"]
    for name in _ROOT_LINKS:
        p = "/" + name
        if os.path.islink(p):
            argv += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            argv += ["--ro-bind", p, p]
    argv += ["--perms", "0755", "--dir", "/etc"]
    for name in _ETC:
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    for name in ("passwd", "group", "hosts"):
        argv += ["--ro-bind", os.path.join(host, name), f"/etc/{name}"]
    argv += ["--dev", "/dev", "--perms", "1777", "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm",
             "--proc", "/proc",
             "--perms", "1777", "--size", str(TMPFS_MB << 20), "--tmpfs", "/tmp"]
    made = {"/tmp", "/etc", "/dev", "/proc"}
    for d in _python_dirs():  # after /tmp: a Python (a venv) under /tmp stays visible
        for a in _ancestors(d):
            if a not in made and not os.path.islink(a):
                argv += ["--perms", "0755", "--dir", a]
                made.add(a)
        argv += ["--ro-bind", d, d]
    argv += ["--perms", "0777", "--dir", work,
             "--perms", "0644", "--file", str(main_fd), os.path.join(work, "main.py"),
             "--remount-ro", "/dev", "--remount-ro", "/",  # the sandbox's own tmpfs root: no writes
             "--chdir", work, "--clearenv"]
    for k, v in _env(work, "/tmp").items():
        argv += ["--setenv", k, v]
    return argv + ["--", sys.executable, "-I", "-S", "-c", _BOOT,
                   str(SANDBOX_UID), str(SANDBOX_GID), str(NPROC)]


def _write_etc(host: str, work: str) -> None:
    files = {"passwd": f"nobody:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:{work}:/usr/sbin/nologin\n",
             "group": f"nogroup:x:{SANDBOX_GID}:\n",
             "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n"}
    for name, text in files.items():
        with open(os.path.join(host, name), "w", encoding="utf-8") as f:
            f.write(text)


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
                _write_etc(tmp, work)
                bpf, seccomp_fd = _seccomp_filter(), None
                if bpf is not None:
                    with open(os.path.join(tmp, "seccomp.bpf"), "wb") as f:
                        f.write(bpf)
                    seccomp_fd = files.enter_context(open(f.name, "rb")).fileno()
                info_r, info_w = os.pipe()  # where bwrap says the host pid of its PID 1
                files.callback(os.close, info_r)
                try:
                    proc = subprocess.Popen(
                        _bwrap_argv(bwrap, tmp, work, fm.fileno(), seccomp_fd, info_w), cwd="/",
                        env=_env(work, "/tmp"),  # bwrap's own environment: nothing of the caller's
                        stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, close_fds=True,
                        pass_fds=tuple(fd for fd in (fm.fileno(), seccomp_fd, info_w) if fd is not None),
                        start_new_session=True, preexec_fn=_limits(memory_mb, cpu_s, nproc=False))
                finally:
                    os.close(info_w)
                pid1 = _pid1(info_r, proc)
                if pid1 is not None:
                    files.callback(os.close, pid1)
            else:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "main.py"], cwd=tmp, env=_env(tmp, tmp),
                    stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, close_fds=True,
                    start_new_session=True, preexec_fn=_limits(memory_mb, cpu_s, nproc=True))
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
