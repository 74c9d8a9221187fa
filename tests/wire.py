"""Bytes one collective puts on the loopback wire, for the multi-process meter tests.

The loopback counters are the machine's, so on a shared machine they count other jobs' traffic
too: :func:`launch_in_netns` runs the ranks in a network namespace of their own, whose ``lo``
carries nothing but theirs.
"""
import ctypes
import fcntl
import importlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, Optional

import pytest

from admm_dist.bench.comm_wire import interface_tx_bytes

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
NO_NETNS = 77           # the child's exit status where it cannot have a namespace of its own
START_S = 60.0          # the child's interpreter and the launcher's fork server, on a loaded machine


def wire_bytes(ctx, comm, vectors, brackets: int = 3) -> int:
    """Bytes ``comm.consensus_(vectors)`` sends over ``lo``, read on rank 0 between barriers
    (0 on the other ranks). A warm-up call first (gloo sets connections up lazily); then the
    smallest of ``brackets`` readings without the call is taken from the smallest with it:
    spurious loopback TCP retransmissions (two ranks sharing a core) only ever add bytes."""
    comm.consensus_(vectors)
    deltas = {False: [], True: []}
    for _ in range(brackets):
        for with_op in (False, True):
            comm.barrier()
            before = interface_tx_bytes("lo") if ctx.rank == 0 else 0
            comm.barrier()
            if with_op:
                comm.consensus_(vectors)
            comm.barrier()
            after = interface_tx_bytes("lo") if ctx.rank == 0 else 0
            comm.barrier()
            deltas[with_op].append(after - before)
    return min(deltas[True]) - min(deltas[False])


def launch_in_netns(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float) -> Dict[int, Any]:
    """``launch_cpu(fn, nprocs, *args, timeout_s=timeout_s)`` in a fresh interpreter that first
    moves into a network namespace of its own (as root; otherwise in a user namespace too) and
    sets its loopback up: the rendezvous, the ranks and their gloo traffic all live there, so
    that ``lo``'s counters count nothing else. Skips the test where no namespace can be made;
    fails, having killed the whole launch, if it has not ended ``START_S`` after ``timeout_s``.
    ``fn`` is a module-level function, named to the child by its module and name; ``args`` and
    what each rank returns go as JSON (rank numbers come back as ints, tuples as lists)."""
    with tempfile.TemporaryDirectory(prefix="admm_netns_") as tmp:
        job, out, err = (os.path.join(tmp, name) for name in ("job.json", "out.json", "stderr.txt"))
        with open(job, "w") as f:
            json.dump({"path": list(sys.path), "module": fn.__module__, "name": fn.__qualname__,
                       "nprocs": nprocs, "args": list(args), "timeout_s": timeout_s}, f)
        with open(err, "wb") as stderr:
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), job, out],
                                    stdin=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s + START_S)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                if proc.returncode is None:   # timed out or interrupted
                    os.killpg(proc.pid, signal.SIGKILL)   # the launcher, its fork server, the ranks
                    proc.wait()
        with open(err, encoding="utf-8", errors="replace") as f:
            said = f.read()
        if rc == NO_NETNS:
            pytest.skip(f"no network namespace of its own here: {said.strip()}")
        if rc is None:
            pytest.fail(f"the launch in its own network namespace did not end in {timeout_s + START_S:.0f} s\n"
                        f"{said[-4000:]}")
        if rc != 0:
            pytest.fail(f"the launch in its own network namespace failed (exit status {rc})\n{said[-4000:]}")
        with open(out) as f:
            return {int(rank): result for rank, result in json.load(f).items()}


def _own_network() -> Optional[str]:
    """Move this process (still one thread: no torch yet) into a new network namespace and set
    its ``lo`` up; None, or why not (one line)."""
    uid, gid = os.getuid(), os.getgid()
    as_user = "" if uid == 0 else " (as a non-root user: in a user namespace)"
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET if uid == 0 else CLONE_NEWUSER | CLONE_NEWNET):
        return f"unshare: {os.strerror(ctypes.get_errno())}{as_user}"
    try:
        if uid != 0:   # the same uid and gid in there, with the powers to set the loopback up
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        with socket.socket() as s:   # struct ifreq: the name, then the flags (40 bytes in all)
            flags = struct.unpack_from("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16s24x", b"lo")))[1]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))
    except OSError as e:
        return f"setting its loopback up: {e.strerror}{as_user}"
    return None


if __name__ == "__main__":   # launch_in_netns's child: python wire.py JOB OUT
    why = _own_network()
    if why:
        print(why, file=sys.stderr)
        sys.exit(NO_NETNS)
    with open(sys.argv[1]) as job:
        spec = json.load(job)
    sys.path[:] = spec["path"]
    target = getattr(importlib.import_module(spec["module"]), spec["name"])
    import multiprocessing.forkserver

    from admm_dist.bench import launcher

    # the fork server imports what the ranks run (the test's module), not the trainer's libraries
    # (transformers, PEFT), which a rank counting bytes never uses: about 4 s of CPU a launch. It
    # starts here, so the launcher's own preload list comes too late to replace this one.
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(["torch", "torch.distributed", spec["module"]])
    multiprocessing.forkserver.ensure_running()
    result = launcher.launch_cpu(target, spec["nprocs"], *spec["args"], timeout_s=spec["timeout_s"])
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
