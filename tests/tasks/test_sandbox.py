"""The code sandbox contains hostile code (real bubblewrap, no mocks), and refuses to run
untrusted code where no isolation is available.

Each hostile probe mirrors one a tester ran against the rlimits-only sandbox: writes outside
its folder, reads of /etc/passwd and of the evaluator's environment through /proc, a socket to
127.0.0.1, killing the evaluator, escaping the kill with setsid, a fork bomb. Every run passes
``allow_unisolated=False``, so none can fall back to running uncontained.
"""
import ast
import base64
import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import zlib

import pytest

from admm_dist.core.errors import RunError
from admm_dist.tasks import bubblewrap, sandbox, scoring
from admm_dist.tasks.sandbox import SandboxUnavailable, run_python

from conftest import REPO
from procs import subreaper

REPO = str(REPO)
AVAILABLE = sandbox.isolation_available()
needs_bwrap = pytest.mark.skipif(not AVAILABLE, reason=f"no working bwrap here: {sandbox.describe()}")
ROOT = os.geteuid() == 0


@pytest.fixture(autouse=True)
def _no_opt_in(monkeypatch):
    monkeypatch.delenv(sandbox.ENV_VAR, raising=False)


def run(code, **kw):
    kw.setdefault("timeout_s", 10.0)
    r = run_python(code, allow_unisolated=False, **kw)
    assert r.isolation == "bwrap"
    return r


def host_processes():
    return sum(name.isdigit() for name in os.listdir("/proc"))


# --------------------------------------------------------------------------- normal code
@needs_bwrap
def test_normal_code_still_works():
    r = run("import collections, decimal, fractions, json, math, re, sqlite3, os, sys\n"
            "open('out.txt', 'w').write('kept')\n"
            "print(open('out.txt').read(), os.getcwd(), sys.flags.isolated, json.dumps([math.pi > 3]))\n")
    kept, cwd, isolated, js = r.stdout_tail.split()
    assert r.ok and r.returncode == 0 and kept == "kept" and "admm_sandbox_" in cwd
    assert isolated == "1" and js == "[true]" and r.stderr_tail == ""
    assert not os.path.exists(cwd)  # its folder was private and is gone
    many = run("import multiprocessing, subprocess, threading\n"
               "out = []\n"
               "ts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]\n"
               "[t.start() for t in ts]; [t.join() for t in ts]\n"
               "with multiprocessing.Pool(2) as pool:\n"
               "    squares = pool.map(abs, [-1, -2])\n"
               "echo = subprocess.run(['echo', 'hi'], capture_output=True, text=True, timeout=5).stdout\n"
               "print(sorted(out) == list(range(8)), squares, echo.strip())\n")
    assert many.ok and many.stdout_tail == "True [1, 2] hi\n", many.stderr_tail  # threads, processes
    bad = run("assert sorted([3, 1]) == [3, 1], 'order'\n")
    assert not bad.ok and bad.returncode == 1 and "AssertionError: order" in bad.stderr_tail


@needs_bwrap
def test_memory_and_time_limits_still_hold():
    bomb = run("x = bytearray(10**10)\n", memory_mb=256, timeout_s=60.0)
    assert not bomb.ok and not bomb.timed_out and "MemoryError" in bomb.stderr_tail
    t = time.monotonic()
    loop = run("while True:\n    pass\n", timeout_s=1.5)
    assert loop.timed_out and not loop.ok and loop.returncode < 0
    assert time.monotonic() - t < 30.0      # ended at its timeout (loose: CI machines are loaded)


# --------------------------------------------------------------------------- hostile code
@needs_bwrap
def test_writes_outside_its_folder_do_not_reach_the_host(tmp_path):
    token = secrets.token_hex(6)
    targets = [str(tmp_path / "escaped.txt"), f"/tmp/admm_escape_{token}", f"/var/tmp/admm_escape_{token}",
               f"/usr/admm_escape_{token}", f"/admm_escape_{token}", f"/etc/admm_escape_{token}"]
    try:
        r = run("import os, sys\n"
                f"for p in {targets!r}:\n"
                "    try:\n"
                "        os.makedirs(os.path.dirname(p), exist_ok=True)\n"
                "        open(p, 'w').write('x')\n"
                "        print('wrote', p)\n"
                "    except OSError as e:\n"
                "        print('refused', p, e.errno)\n")
        assert r.ok
        for p in targets:
            assert not os.path.exists(p), f"the sandbox wrote {p} on the host"
        for p in targets[3:]:  # the system and the sandbox's own root are read-only
            assert f"refused {p}" in r.stdout_tail
    finally:
        for p in targets[1:3]:
            if os.path.exists(p):
                os.remove(p)


def ways_to_the_python():
    """{folder: the entries the sandbox may show there} for every host folder on the way down to
    the interpreter's own prefixes (``sys.prefix``, ``sys.base_prefix``, as given and resolved),
    wherever they live (a pyenv under /root/.pyenv, a venv inside the clone or under /root/.cache,
    ...): only the next step towards a prefix, never its siblings. /usr is shown whole, and /tmp
    is the sandbox's own (it holds the working folder too); a folder on no way is not there."""
    ways = {}
    for p in (sys.prefix, sys.base_prefix):
        for q in {os.path.abspath(p), os.path.realpath(p)}:
            if q == "/usr" or q.startswith("/usr/"):
                continue
            parts = q.strip("/").split("/")
            for i in range(1, len(parts)):
                ways.setdefault("/" + "/".join(parts[:i]), set()).add(parts[i])
    ways.pop("/tmp", None)
    return ways


@needs_bwrap
def test_host_files_and_the_callers_environment_are_hidden(tmp_path, monkeypatch):
    """Of the host the sandbox shows /usr, a few /etc files and the interpreter's prefixes, whole
    and read-only; a folder above a prefix is there only as the way down to it. So with a venv
    inside the clone the clone's folder is there holding ``.venv`` alone: the clone's own files
    (the package, the tests, results, checkpoints) are not, nor /home, /root, other files under
    /work, or the caller's environment."""
    env_secret, file_secret = secrets.token_hex(12), secrets.token_hex(12)
    monkeypatch.setenv("ADMM_TEST_SECRET", env_secret)
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(file_secret)
    secret_file.chmod(0o644)  # readable by anyone: hiding it is the sandbox's job, not the mode's
    ways = ways_to_the_python()
    host = sorted({"/home", "/work", "/root", REPO} | set(ways))  # each shows at most its way, or is not there
    mine = [os.path.join(REPO, name) for name in ("admm_dist", "tests", "README.md")] + [os.path.abspath(__file__)]
    r = run("import base64, glob, os, zlib\n"
            "seen = [repr(dict(os.environ))]\n"
            f"paths = ['/etc/passwd', '/etc/shadow', {str(secret_file)!r}, {os.path.abspath(__file__)!r}]\n"
            "paths += [f'/proc/{os.getppid()}/environ'] + glob.glob('/proc/[0-9]*/environ')\n"
            "paths += glob.glob('/proc/[0-9]*/cmdline')\n"
            "for p in paths:\n"
            "    try:\n"
            "        seen.append(open(p, 'rb').read().decode('utf-8', 'replace'))\n"
            "    except OSError as e:\n"
            "        seen.append(f'{p}: {e.strerror}')\n"
            f"for d in {['/', '/tmp', '/etc'] + host!r}:\n"
            "    seen.append(f'{d}: {sorted(os.listdir(d)) if os.path.isdir(d) else None}')\n"
            f"seen.append(repr([p for p in {mine!r} if os.path.exists(p)]))\n"
            "print(base64.b64encode(zlib.compress('\\n'.join(seen).encode(), 9)).decode())\n")
    assert r.ok and len(r.stdout_tail) < sandbox.TAIL_CHARS, r.stderr_tail
    out = zlib.decompress(base64.b64decode(r.stdout_tail)).decode()
    assert env_secret not in out and file_secret not in out
    with open("/etc/passwd") as f:
        host_passwd = f.read()
    assert host_passwd not in out and "root:x:0:0" not in out
    assert f"nobody:x:{bubblewrap.sandbox_uid()}:" in out  # the made-up one (this thread's run)
    assert out.rstrip().endswith("[]")  # none of the clone's own files, wherever the Python lives
    listings = dict(line.split(": ", 1) for line in out.splitlines() if line.split(": ", 1)[0] in host)
    for folder in host:  # at most the way to the Python, else nothing
        shown = ast.literal_eval(listings[folder])   # a sorted list of names, or None
        if folder in ways:
            assert set(shown or []) <= ways[folder], (folder, shown, sorted(ways[folder]))
        else:
            assert shown is None, (folder, shown)


@needs_bwrap
def test_a_venv_inside_the_clone_shows_the_clones_folder_holding_it_alone(tmp_path, monkeypatch):
    """The common layout (``python3 -m venv .venv`` in the clone) wherever the suite itself runs:
    the sandbox runs that venv's Python and sees its packages, and of the clone only the way to
    the venv."""
    clone = tmp_path / "clone"
    (clone / "admm_dist").mkdir(parents=True)
    (clone / "admm_dist" / "secret.py").write_text(f"TOKEN = {secrets.token_hex(8)!r}\n")
    venv = clone / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "exec_prefix", str(venv))
    r = run("import os, sys\n"
            f"print(sys.prefix, sorted(os.listdir({str(clone)!r})), os.path.exists({str(clone / 'admm_dist')!r}))\n")
    assert r.ok, r.stderr_tail
    assert r.stdout_tail.split("\n")[0] == f"{venv} ['.venv'] False"


@needs_bwrap
def test_an_interpreter_reached_through_a_link_shows_that_link_not_its_folder(tmp_path, monkeypatch):
    """``sys.executable`` may be a link in a folder of its own (``~/.local/bin/python3`` to a
    pyenv or a venv): the sandbox re-makes that one link; the folder's other files stay hidden."""
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "python3").symlink_to(os.path.realpath(sys.executable))
    (shims / "secret.txt").write_text(secrets.token_hex(8))
    (shims / "secret.txt").chmod(0o644)
    monkeypatch.setattr(sys, "executable", str(shims / "python3"))
    r = run("import os, sys\n"
            f"print(sorted(os.listdir({str(shims)!r})), os.path.islink({str(shims / 'python3')!r}), "
            "sys.version_info[:2])\n")
    assert r.ok, r.stderr_tail
    assert r.stdout_tail.split("\n")[0] == f"['python3'] True {tuple(sys.version_info[:2])}"


@needs_bwrap
def test_no_network_not_even_to_the_hosts_loopback():
    token = secrets.token_hex(6)
    with socket.socket() as listener, socket.socket(socket.AF_UNIX) as abstract:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        abstract.bind(f"\0admm_sandbox_test_{token}")
        abstract.listen(8)
        r = run("import socket\n"
                f"for family, addr in [(socket.AF_INET, ('127.0.0.1', {port})),\n"
                "                     (socket.AF_INET, ('1.1.1.1', 53)),\n"
                f"                     (socket.AF_UNIX, '\\0admm_sandbox_test_{token}')]:\n"
                "    s = socket.socket(family)\n"
                "    s.settimeout(2)\n"
                "    try:\n"
                "        s.connect(addr)\n"
                "        print('CONNECTED', addr)\n"
                "    except OSError as e:\n"
                "        print('failed', e.errno)\n")
        for sock in (listener, abstract):
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.accept()  # nothing ever reached this end
    assert r.ok and "CONNECTED" not in r.stdout_tail and r.stdout_tail.count("failed") == 3


@needs_bwrap
def test_the_code_cannot_signal_the_caller():
    r = run("import os, signal\n"
            "print('ppid', os.getppid())\n"
            f"for pid in (os.getppid(), {os.getpid()}, {os.getppid()}, 1, -1):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "        print('sent', pid)\n"
            "    except OSError as e:\n"
            "        print('refused', pid, e.errno)\n"
            "print('still here')\n")
    # We are alive to check. Inside, the parent is the sandbox's init, which ignores SIGKILL
    # from its own namespace; this process's pid names nothing in there.
    assert r.stdout_tail.splitlines()[0] == "ppid 1"
    assert f"refused {os.getpid()} 3" in r.stdout_tail and r.ok and "still here" in r.stdout_tail


@needs_bwrap
def test_a_setsid_child_does_not_outlive_the_run(tmp_path):
    late = [str(tmp_path / "late.txt"), f"/tmp/admm_late_{secrets.token_hex(6)}"]
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:  # and a second fork, as a daemon does\n"
            "        time.sleep(1.0)\n"
            f"        for p in {late!r}:\n"
            "            try:\n"
            "                open(p, 'w').write('escaped')\n"
            "            except OSError:\n"
            "                pass\n"
            "        time.sleep(60)\n"
            "    os._exit(0)\n"
            "print('parent leaves')\n")
    with subreaper() as left:
        t = time.monotonic()
        r = run(code)
        assert r.ok and time.monotonic() - t < 30.0  # it did not wait for the child (which sleeps 60 s)
        deadline = time.monotonic() + 2.5  # past the moment the child would write
        while time.monotonic() < deadline:
            assert not left() and not any(os.path.exists(p) for p in late)
            time.sleep(0.1)
    for p in late[1:]:
        if os.path.exists(p):
            os.remove(p)


@needs_bwrap
def test_sandboxes_started_from_many_threads_at_once_all_finish():
    # Scoring runs a chain's programs from a thread pool. The limits are set by a program of their
    # own, not a preexec_fn between fork and exec, where a lock held by another thread at the fork
    # can deadlock the child (it did, with two threads).
    start, results = threading.Barrier(6), []

    def one(i):
        start.wait(10)
        for j in range(3):
            results.append(run(f"print({i} * 10 + {j})", timeout_s=20.0))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a sandbox started from a thread never finished"
    assert sorted(int(r.stdout_tail) for r in results if r.ok) == sorted(i * 10 + j for i in range(6) for j in range(3))


@needs_bwrap
def test_a_fork_bomb_is_limited_ends_with_its_timeout_and_leaves_a_concurrent_run_its_budget():
    base = host_processes()
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            peak.append(host_processes())
            time.sleep(0.05)

    code = ("import os, time\n"
            "n = 0\n"
            "for _ in range(2000):\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(60)\n"
            "            os._exit(0)\n"
            "        n += 1\n"
            "    except OSError as e:\n"
            "        print('fork refused:', e.strerror, flush=True)\n"
            "        break\n"
            "    print(n, flush=True)\n"
            "time.sleep(60)\n")
    # A second program that needs 20 processes, started while the bomb holds its whole budget
    # (as root, every run's program has a uid of its own: the budget is per run, not shared).
    needy = ("import os, time\n"
             "kids = []\n"
             "for _ in range(20):\n"
             "    kid = os.fork()\n"
             "    if kid == 0:\n"
             "        time.sleep(0.5)\n"
             "        os._exit(0)\n"
             "    kids.append(kid)\n"
             "for kid in kids:\n"
             "    os.waitpid(kid, 0)\n"
             "print(len(kids))\n")
    # The second run is another process's (another caller on the host; concurrent runs from threads
    # of one process: the test below): it starts once the host's process count shows the bomb
    # near its limit.
    beside_py = ("import json, os, sys, time\n"
                 "from admm_dist.tasks.sandbox import run_python\n"
                 "base, need, code = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]\n"
                 "t = time.monotonic()\n"
                 "count = lambda: sum(n.isdigit() for n in os.listdir('/proc'))\n"
                 "while count() - base < need and time.monotonic() - t < 3.0:\n"
                 "    time.sleep(0.05)\n"
                 "at = count() - base\n"
                 "r = run_python(code, allow_unisolated=False)\n"
                 "print(json.dumps([at, r.ok, r.isolation, r.stdout_tail.strip(), r.stderr_tail]))\n")
    watcher = threading.Thread(target=sample, daemon=True)
    with subreaper() as left:
        watcher.start()
        beside = subprocess.Popen([sys.executable, "-c", beside_py, str(base), str(sandbox.NPROC * 3 // 4), needy],
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t = time.monotonic()
        try:
            r = run(code, timeout_s=4.0)
            took = time.monotonic() - t
            out, err = beside.communicate(timeout=60)
        finally:
            if beside.poll() is None:
                beside.kill()
                beside.wait()
            stop.set()
            watcher.join(5)
        assert r.timed_out and r.returncode < 0 and took < 4.0 + 20.0, took  # ended at its timeout, not the child's 60 s
        counts = [int(line) for line in r.stdout_tail.split("\n") if line.isdigit()]
        refused = "fork refused: Resource temporarily unavailable" in r.stdout_tail
        assert counts and counts[-1] < sandbox.NPROC, r.stdout_tail  # never more than the limit
        assert not refused or counts[-1] > sandbox.NPROC // 2  # and the limit is what stopped it
        assert beside.returncode == 0, err[-2000:]
        at_limit, ok, isolation, stdout, stderr = json.loads(out.strip().splitlines()[-1])
        assert ok and isolation == "bwrap" and stdout == "20", (at_limit, stderr)
        # When run_python returns, all of it is gone (bwrap exits after its PID namespace).
        assert not left()
        # On the host (other users of this machine move the count a little): far from 2000.
        assert max(peak) - base < sandbox.NPROC + 300, (base, max(peak))
        assert host_processes() <= base + 100, (base, host_processes())


@needs_bwrap
@pytest.mark.skipif(bubblewrap.seccomp_filter() is None, reason="no seccomp filter on this machine")
def test_no_nested_namespaces_no_vsock_no_memfd():
    nr = bubblewrap.CLONE_NR[0 if os.uname().machine in ("x86_64", "amd64") else 1]
    r = run("import ctypes, os, socket\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "for flag in (0x10000000, 0x20000, 0x40000000):  # CLONE_NEWUSER, NEWNS, NEWNET\n"
            "    print('unshare', libc.unshare(flag), ctypes.get_errno())\n"
            f"pid = libc.syscall({nr}, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD)\n"
            "if pid == 0:\n"
            "    os._exit(0)\n"
            "print('clone', pid, ctypes.get_errno())\n"
            "for make in (lambda: socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM),\n"
            "             lambda: os.memfd_create('m')):\n"
            "    try:\n"
            "        make()\n"
            "        print('made')\n"
            "    except OSError as e:\n"
            "        print('refused', e.errno)\n")
    assert r.ok, r.stderr_tail
    assert r.stdout_tail.split("\n")[:6] == ["unshare -1 1"] * 3 + ["clone -1 1", "refused 1", "refused 38"]


# --------------------------------------------------------------------------- the policy
def test_refuses_without_a_sandbox(monkeypatch):
    monkeypatch.setattr(sandbox, "BWRAP", "/nonexistent/bwrap")  # the no-tool configuration
    assert not sandbox.isolation_available()
    assert sandbox.describe().startswith("code sandbox: unavailable: no bubblewrap at /nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable) as exc:
        run_python("print(1)")
    msg = str(exc.value)
    assert "\n" not in msg and "apt-get install bubblewrap" in msg
    assert isinstance(exc.value, OSError)  # so the CLIs print it as one line
    assert isinstance(exc.value, RunError) and isinstance(exc.value, RuntimeError)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        scoring.score("```python\nprint(1)\n```", "assert True", "code")  # no silent "wrong"
    monkeypatch.setenv(sandbox.ENV_VAR, "sometimes")
    with pytest.raises(SandboxUnavailable, match="unisolated"):
        sandbox.isolation()


@pytest.mark.skipif(not ROOT, reason="the root rule needs root")
def test_never_runs_uncontained_as_root_even_when_opted_in(monkeypatch):
    monkeypatch.setattr(sandbox, "BWRAP", "/nonexistent/bwrap")
    for opt_in in ({"allow_unisolated": True}, {}):
        if not opt_in:
            monkeypatch.setenv(sandbox.ENV_VAR, "unisolated")
        with pytest.raises(SandboxUnavailable,
                           match="never run as root.*apt-get install bubblewrap.*unprivileged"):
            run_python("print(1)", **opt_in)


def test_a_bwrap_that_cannot_start_is_detected_once(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    fake = tmp_path / "bwrap"  # a bwrap that fails as in a container without namespaces
    fake.write_text(f"#!/bin/sh\necho x >> {calls}\n"
                    "echo 'bwrap: Creating new namespace failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sandbox, "BWRAP", str(fake))
    for _ in range(3):
        assert not sandbox.isolation_available()
        with pytest.raises(SandboxUnavailable,
                           match="cannot start a sandbox here .bwrap: Creating new namespace failed"):
            run_python("print(1)")
    assert calls.read_text() == "x\n"  # probed once, then cached
    with pytest.raises(SandboxUnavailable, match=r"exit status 1"):
        run_python("print(1)", bwrap=shutil.which("false"))


# --------------------------------------------------------------------------- a non-root caller
NOBODY_CHECK = r'''
import ctypes, json, os, sys, types
for name in ("admm_dist", "admm_dist.core", "admm_dist.tasks"):  # the packages, not their faces
    pkg = types.ModuleType(name)
    pkg.__path__ = [os.path.join(sys.argv[1], *name.split("."))]
    sys.modules[name] = pkg
import admm_dist.tasks.sandbox as sb
out = {"uid": os.getuid(), "describe": sb.describe()}
r = sb.run_python("import os, time\nn = 0\nfor _ in range(2000):\n    try:\n        pid = os.fork()\n"
                  "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n"
                  "        os._exit(0)\n    n += 1\nprint(os.getresuid()[0], n)\n", timeout_s=8.0,
                  allow_unisolated=False)
out["bomb"] = [r.ok, r.isolation, r.stdout_tail.split()]
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # a child subreaper: what outlives a run comes here
r = sb.run_python("import ctypes, os, time\n"
                  "print(ctypes.CDLL(None, use_errno=True).ptrace(16, 1, 0, 0), flush=True)\n"
                  "if os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(60)\n",
                  timeout_s=1.5, allow_unisolated=False)
left = []
for n in filter(str.isdigit, os.listdir("/proc")):
    try:
        state, ppid = open(f"/proc/{n}/stat").read().rsplit(")", 1)[1].split()[:2]
    except OSError:
        continue
    if ppid == str(os.getpid()) and state != "Z":
        left.append(n)
out["timeout"] = [r.timed_out, r.stdout_tail.split(), left]
sb.BWRAP = "/nonexistent/bwrap"
try:
    sb.run_python("print(1)")
    out["refused"] = None
except sb.SandboxUnavailable as e:
    out["refused"] = str(e)
r = sb.run_python("print('plain')", allow_unisolated=True)
out["opted_in"] = [r.ok, r.isolation, r.stdout_tail.strip()]
print(json.dumps(out))
'''


@pytest.mark.skipif(not (ROOT and AVAILABLE and os.path.exists("/usr/bin/python3")),
                    reason="needs root (to become nobody), a working bwrap and /usr/bin/python3")
def test_a_non_root_caller_gets_a_user_namespace_and_may_opt_out():
    def become_nobody():
        os.setgroups([])
        os.setgid(sandbox.SANDBOX_GID)
        os.setuid(sandbox.SANDBOX_UID)

    srcs = [os.path.abspath(m.__file__) for m in (sandbox, bubblewrap, sys.modules[RunError.__module__])]
    if any(not os.access(src, os.R_OK) or os.stat(src).st_mode & stat.S_IROTH == 0 for src in srcs):
        pytest.skip("the sandbox modules are not readable by nobody here")

    def searchable_by_others(path):     # every folder down to path (e.g. a mktemp -d clone is 0700)
        path = os.path.abspath(path)
        while True:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
            if path == os.path.dirname(path):
                return True
            path = os.path.dirname(path)
    if not all(searchable_by_others(os.path.dirname(src)) for src in srcs):
        pytest.skip("the sandbox module's folder is not reachable by nobody here")
    p = subprocess.run(["/usr/bin/python3", "-I", "-c", NOBODY_CHECK, REPO], preexec_fn=become_nobody,
                       cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    if p.returncode and "Permission denied" in p.stderr and REPO in p.stderr:
        pytest.skip("the sandbox module's folder is not reachable by nobody here")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["uid"] == sandbox.SANDBOX_UID and out["describe"].startswith("code sandbox: bwrap")
    ok, isolation, (uid, forked) = out["bomb"]
    assert ok and isolation == "bwrap" and uid == str(sandbox.SANDBOX_UID) and int(forked) < sandbox.NPROC
    # It cannot ptrace its PID 1 (itself here: no bwrap process shares its uid unfiltered), and
    # a setsid child does not outlive the timeout.
    assert out["timeout"] == [True, ["-1"], []]
    assert "ADMM_SANDBOX=unisolated" in out["refused"] and "apt-get install bubblewrap" in out["refused"]
    assert out["opted_in"] == [True, "rlimits-only", "plain"]
