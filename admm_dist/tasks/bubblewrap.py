"""The bubblewrap side of the code sandbox (:mod:`admm_dist.tasks.sandbox`): what the sandbox is.

:func:`bwrap_argv` builds the ``bwrap`` command line (namespaces, the read-only filesystem,
the private tmpfs ``/tmp``, the uid, the environment, the boot script that sets the task
limit and drops root); :func:`seccomp_filter` builds the classic-BPF program bwrap loads
with ``--seccomp``; :func:`write_etc` writes the made-up ``/etc`` files; :func:`pid1_fd`
turns what bwrap reports on ``--info-fd`` into a pidfd for the sandbox's PID 1.
:func:`minimal_env` is the environment every sandboxed program gets (isolated or not).

The policy (which bwrap, probing it, refusing) and the running (timeouts, limits, results)
stay in :mod:`admm_dist.tasks.sandbox`. See docs/sandbox.md.
"""
from __future__ import annotations

import errno
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

NPROC = 256          # tasks (processes and threads) the sandbox user may have
TMPFS_MB = 64        # what the code can write to /tmp and its working folder there, together
SHM_MB = 16          # and to /dev/shm (POSIX shared memory, multiprocessing's semaphores)
SANDBOX_UID = SANDBOX_GID = 65534   # nobody / nogroup: who the program is in its user namespace
# As root (no user namespace), each run's program gets a host uid of its own, so that concurrent
# sandboxes never share the per-uid task budget: this base plus the id of the thread that runs
# and waits for it (alive, hence unique on the host, for as long as the run lasts). Thread ids
# stay below 2**22 (the kernel's PID_MAX_LIMIT): the range ends below 2**31, above the ranges
# systemd gives to containers (0x80000-0x6fffffff), and no user database lists it.
RUN_UID_BASE = 0x7F000000

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
CLONE_NR, SOCKET_NR = (56, 220), (41, 198)   # (x86_64, aarch64): filtered by their arguments
_CLONE_NEW = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_AF_VSOCK = 40
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives")
_ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


def minimal_env(home: str, tmp: str) -> dict:
    """The whole environment of a sandboxed program (and of bwrap itself)."""
    one = "1"  # one thread per numeric library, so imports fit the address-space limit
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": one, "OPENBLAS_NUM_THREADS": one,
            "MKL_NUM_THREADS": one}


def pid1_fd(info_r: int, proc: subprocess.Popen) -> Optional[int]:
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


def _under(path: str, folders: List[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def _python_dirs() -> List[str]:
    """The running Python's prefixes (``sys.prefix``, ``sys.base_prefix``, the exec ones), as
    given and resolved, outside /usr: the folders bound whole. Their siblings stay hidden (a venv
    in ``/root/.cache/venv-x`` shows ``/root/.cache`` holding that venv alone)."""
    dirs: List[str] = []
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        if not p:
            continue
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if q not in dirs:
                dirs.append(q)
    keep: List[str] = []
    for d in sorted(dirs, key=len):
        if d != "/" and not _under(d, keep + ["/usr"]):
            keep.append(d)
    return keep


def _interpreter_outside(keep: List[str]) -> Tuple[List[str], Optional[str]]:
    """The way to ``sys.executable`` where it lies outside ``keep`` and /usr (rare: a link in a
    folder of its own, such as ~/.local/bin/python3): the links on that way, re-made in the
    sandbox pointing at the resolved file, and that file when it too lies outside (bound alone).
    Only those paths, never their folders, whose other files are none of the sandbox's."""
    exe = sys.executable
    if not exe:
        return [], None
    seen = keep + ["/usr"]
    real = os.path.realpath(exe)
    links: List[str] = []
    p = os.path.abspath(exe)
    for _ in range(40):   # a chain of links, bounded as the kernel bounds it
        if _under(p, seen) or not os.path.islink(p):
            break
        links.append(p)
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return links, (None if _under(real, seen) else real)


def _ancestors(path: str) -> List[str]:
    out, p = [], os.path.dirname(path)
    while p not in ("/", ""):
        out.append(p)
        p = os.path.dirname(p)
    return out[::-1]


def seccomp_filter() -> Optional[bytes]:
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
    prog += [(jeq, CLONE_NR[arch], "clone", None), (jeq, SOCKET_NR[arch], "socket", None),
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


def sandbox_uid() -> int:
    """The uid of the program of a sandbox that this thread runs: :data:`SANDBOX_UID` in a user
    namespace; as root, :data:`RUN_UID_BASE` plus this thread's id (one uid per concurrent run)."""
    return RUN_UID_BASE + threading.get_native_id() if os.geteuid() == 0 else SANDBOX_UID


def bwrap_argv(bwrap: str, host: str, work: str, main_fd: int, seccomp_fd: Optional[int],
               info_fd: int) -> List[str]:
    """The command line that runs ``main.py`` (open as ``main_fd``) in ``work`` under ``bwrap``,
    as :func:`sandbox_uid`; ``host`` holds the files :func:`write_etc` wrote."""
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

    def way_to(path: str) -> None:   # the folders above ``path``, empty but for the way down
        for a in _ancestors(path):
            if a not in made and not os.path.islink(a):
                argv.extend(["--perms", "0755", "--dir", a])
                made.add(a)

    keep = _python_dirs()
    links, exe_file = _interpreter_outside(keep)
    for d in keep:  # after /tmp: a Python (a venv) under /tmp stays visible
        way_to(d)
        argv += ["--ro-bind", d, d]
    if exe_file is not None:
        way_to(exe_file)
        argv += ["--ro-bind", exe_file, exe_file]
    for link in links:
        way_to(link)
        argv += ["--symlink", os.path.realpath(sys.executable), link]
    argv += ["--perms", "0777", "--dir", work,
             "--perms", "0644", "--file", str(main_fd), os.path.join(work, "main.py"),
             "--remount-ro", "/dev", "--remount-ro", "/",  # the sandbox's own tmpfs root: no writes
             "--chdir", work, "--clearenv"]
    for k, v in minimal_env(work, "/tmp").items():
        argv += ["--setenv", k, v]
    return argv + ["--", sys.executable, "-I", "-S", "-c", _BOOT,
                   str(sandbox_uid()), str(SANDBOX_GID), str(NPROC)]


def write_etc(host: str, work: str) -> None:
    """The made-up ``passwd``, ``group`` and ``hosts`` of the sandbox, written into ``host``."""
    files = {"passwd": f"nobody:x:{sandbox_uid()}:{SANDBOX_GID}:sandbox:{work}:/usr/sbin/nologin\n",
             "group": f"nogroup:x:{SANDBOX_GID}:\n",
             "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n"}
    for name, text in files.items():
        with open(os.path.join(host, name), "w", encoding="utf-8") as f:
            f.write(text)
