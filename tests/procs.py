"""Process helpers for the tests: everything by PID, from /proc; nothing by name."""
import contextlib
import ctypes
import os


@contextlib.contextmanager
def subreaper():
    """While inside, whatever this process's descendants orphan is reparented to it."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    assert prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    try:
        yield
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
