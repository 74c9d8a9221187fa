"""Process helpers for the tests: everything by PID, from /proc; nothing by name."""
import contextlib
import ctypes
import os


@contextlib.contextmanager
def subreaper():
    """While inside, whatever this process's descendants orphan is reparented to it. Yields
    ``left()``: the live children that were not there on entry (earlier tests leave some,
    e.g. multiprocessing's resource tracker, which are none of the code under test's)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    before = set(live_children())
    assert prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    try:
        yield lambda: [pid for pid in live_children() if pid not in before]
    finally:
        prctl(36, 0, 0, 0, 0)


def live_children():
    """Live children of this process (by PID, from /proc); zombies are reaped."""
    me, live = os.getpid(), []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == me:
            if state == "Z":
                os.waitpid(int(name), os.WNOHANG)
            else:
                live.append(int(name))
    return live


def kill_at_once(pids):
    """SIGSTOP every PID, then SIGKILL every one: none of them can react to another's death in
    between (an agent restarting its workers, a worker reporting a peer). PIDs that are gone
    already are skipped."""
    import signal

    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
