"""An elastic job on two hosts: torchrun's own elastic agent (``--nnodes 1:2``, c10d rendezvous,
``--max-restarts``) in two network namespaces joined by a veth pair (tests/cluster.py), 2 ranks
per host for a run of N = 4 nodes.

Host 1 holds global rank 0 (the run's lock, its results) and is killed with SIGKILL in the
middle of the run: its agent and its workers, by PID (torchrun starts each worker in a session
of its own, so the agent's process group would miss them). Host 0's agent (which hosts the c10d
store) restarts its workers in a one-host world (W = 2 ranks for 4 nodes); they take over the
lock, resume from the last checkpoint and go on. Host 1 is then started again and taken back at
the next rendezvous (W = 4). Both torchruns exit 0 and the final z and every node file are
bit-identical to an uninterrupted run. The ranks run ``-m tests.launch.held_train``, the training
command whose survivors, in the one-host world, wait after their second round until their agent
stops them to take host 1 back: the run cannot end before host 1 is back, whatever the load, so
it needs few rounds. The collective timeout stays at its default (600 s): a killed host's sockets
close, so nobody waits it out. The test prints the stall (kill -> first round the survivors
complete) and the rejoin time (restart -> first round with both hosts); docs/elastic.md records
them, and why TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is needed.

Slow (``python3 -m pytest -m slow -n 0 tests/launch/test_elastic.py``); needs root, iproute2
and util-linux (ip, nsenter), and permission to create network namespaces. No SLURM.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from cluster import (
    ELASTIC_ARGS,
    REPO,
    NetnsPair,
    assert_same_outputs,
    free_port,
    netns_missing,
    reference,
    tiny_assets,
    train_args,
    wait_for,
)
from procs import kill_at_once, subreaper

N = 4          # nodes (seats); 2 hosts x 2 ranks
K = ELASTIC_ARGS["k_outer"]   # rounds: the kill lands by round 6, the survivors hold 2 rounds on
KILL_AT = 4    # host 1 dies once round KILL_AT is logged
BACK_AFTER = 2  # ... and comes back once the survivors have completed this many rounds (and hold)
RDZV_ID = "elastic-test"
# How quickly the agents see a change (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py):
# a dead agent is dropped from the rendezvous after keep_alive_interval x keep_alive_max_attempt
# seconds without a heartbeat; a rendezvous that has reached --nnodes' minimum waits
# last_call_timeout more seconds for others before it completes; the agent checks its workers and
# the waiting nodes every --monitor-interval seconds.
RDZV_CONF = "join_timeout=120,last_call_timeout=3,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
MONITOR = "0.5"
TIMEOUT_S = 600  # the run's collective timeout: the default, which nobody waits out here

pytestmark = [pytest.mark.slow]

ROUND = re.compile(r"^round +(\d+)/(\d+) ")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"), N)


@pytest.fixture(scope="module")
def two_seats(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets2"), 2)


@pytest.fixture
def net():
    why = netns_missing()
    if why:
        pytest.skip(why)
    with NetnsPair() as pair:
        yield pair


def run_args(assets, out: Path, **kw) -> List[str]:
    return train_args(assets, out, **{**ELASTIC_ARGS, **kw})


class Host:
    """One host's torchrun (agent + workers) in its own session, its output lines timestamped."""

    def __init__(self, name: str, cmd: List[str], env: dict, log: Path):
        self.name, self.cmd, self.env, self.log = name, cmd, env, log
        self.lines: List[Tuple[float, str]] = []
        self.lock = threading.Lock()
        self.proc: Optional[subprocess.Popen] = None
        self.reader: Optional[threading.Thread] = None

    def start(self) -> "Host":
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO))
        self.reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self.reader.start()
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        with open(self.log, "a") as fh:
            for raw in proc.stdout:
                t = time.monotonic()
                text = raw.decode(errors="replace").rstrip("\n")
                with self.lock:
                    self.lines.append((t, text))
                fh.write(f"{t:.3f} {text}\n")
                fh.flush()

    def snapshot(self) -> List[Tuple[float, str]]:
        with self.lock:
            return list(self.lines)

    def rounds(self, since: float = 0.0) -> List[Tuple[float, int]]:
        return [(t, int(m.group(1))) for t, s in self.snapshot() if t >= since and (m := ROUND.match(s))]

    def tree(self) -> List[int]:
        """The agent and its descendants (by PID, from /proc). torchrun starts each worker in a
        session of its own (start_new_session=True), so the agent's process group is not enough."""
        kids = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as fh:
                        kids.setdefault(int(fh.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
                except (OSError, IndexError, ValueError):
                    pass
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += kids.get(pid, [])
        return out

    def kill(self) -> List[int]:
        """SIGKILL the agent and every worker it started, at once: stopped first, so the agent
        cannot react to its workers' deaths in between."""
        pids = self.tree()
        kill_at_once(pids)
        self.proc.wait(timeout=30)
        self.reader.join(timeout=30)
        return pids

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=30)
        return rc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()

    def tail(self, n: int = 4000) -> str:
        return "\n".join(f"[{self.name} {t:.1f}] {s}" for t, s in self.snapshot())[-n:]


def rounds(hosts: List[Host], since: float = 0.0) -> List[Tuple[float, int]]:
    """Every ``round k/K`` line (rank 0 prints them, wherever rank 0 is), in time order."""
    return sorted(r for h in hosts for r in h.rounds(since))


@pytest.mark.timeout(600)
def test_elastic_job_loses_a_host_goes_on_and_takes_it_back_bit_for_bit(net, assets, tmp_path):
    _elastic(net, assets, tmp_path, N)


@pytest.mark.timeout(600)
def test_an_elastic_job_of_two_ranks_per_seat_goes_on_at_one_and_takes_the_host_back(net, two_seats, tmp_path):
    """2 seats, 2 hosts x 2 ranks: k = 2, each seat's group on one host. With host 1 gone the
    survivors go on at W = 2 (k = 1, a seat per rank); host 1 back, at k = 2 again. With
    micro_batches=2 the numbers are the same at every W: the end is the uninterrupted run's."""
    _elastic(net, two_seats, tmp_path, 2, micro_batches=2)


def _elastic(net, assets, tmp_path, n, **extra):
    t0 = time.monotonic()
    port = free_port()
    # torchrun orders the agents of a rendezvous by --local-addr: host 1 ("alpha") sorts first,
    # so global rank 0 (the rank that holds the run's lock and writes its results) is on the
    # host that is killed, and moves to host 0 ("bravo") while host 1 is away
    names = ["bravo", "alpha"]
    hosts_file = net.hosts_file(tmp_path, names)
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: see docs/elastic.md (with the shared store, torch
    # 2.13's rank-0 agent never publishes the store's address to a host that joins later)
    env = dict(os.environ, GLOO_SOCKET_IFNAME=net.ifname[0], OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               PYTHONUNBUFFERED="1", LOGLEVEL="INFO", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               ADMM_TEST_HOLD_ROUNDS=str(BACK_AFTER))
    args = run_args(assets, tmp_path / "cut", timeout_s=TIMEOUT_S, **extra)
    hosts: List[Host] = []

    def host(i: int, attempt: int) -> Host:
        cmd = net.prefix(i, names[i], hosts_file) + [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node", "2",
            "--max-restarts", "3", "--monitor-interval", MONITOR, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{net.addr[0]}:{port}", "--rdzv-id", RDZV_ID,
            "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'},{RDZV_CONF}",
            "--local-addr", names[i], "-m", "tests.launch.held_train"] + args
        h = Host(f"{names[i]}.{attempt}", cmd, env, tmp_path / f"{names[i]}.{attempt}.log")
        hosts.append(h)
        return h

    with subreaper() as left:    # workers orphaned by a killed agent come to this process
        try:
            # the reference: this host, uninterrupted, same config (once per test session: the
            # SLURM elastic test of test_multinode.py runs the same one)
            ref = reference(assets, tmp_path / "ref", **ELASTIC_ARGS, **extra)
            t_ref = time.monotonic()

            h0, h1 = host(0, 0), host(1, 0)
            h1.start()   # host 0 hosts the c10d store; host 1's agent retries until it is up
            h0.start()
            try:
                wait_for(lambda: any(r >= KILL_AT for _, r in rounds(hosts)) or h0.proc.poll() is not None
                         or h1.proc.poll() is not None, 300, f"round {KILL_AT}")
            except TimeoutError as e:
                pytest.fail(f"{e}\n{h0.tail()}\n{h1.tail()}")
            assert h0.proc.poll() is None and h1.proc.poll() is None, (h0.tail(), h1.tail())
            assert h1.rounds() and not h0.rounds(), "rank 0 is not on host 1"
            t_kill = time.monotonic()
            killed = h1.kill()
            # the survivors: restarted by host 0's agent in a one-host world, resumed, going on
            try:
                wait_for(lambda: h0.rounds(since=t_kill)[BACK_AFTER - 1:] or h0.proc.poll() is not None,
                         300, "the survivors' rounds")
            except TimeoutError as e:
                pytest.fail(f"{e}\n{h0.tail()}")
            assert h0.proc.poll() is None, h0.tail()
            survived = h0.rounds(since=t_kill)
            t_back = time.monotonic()
            h1b = host(1, 1).start()
            rc0 = h0.wait(timeout=400)
            rc1 = h1b.wait(timeout=120)
            t_end = time.monotonic()
        finally:
            for h in hosts:
                h.stop()
            for pid in left():
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
    logs = "\n".join(h.tail(6000) for h in hosts)
    assert rc0 == 0 and rc1 == 0, (rc0, rc1, logs)
    assert len(killed) == 3, killed    # host 1's agent and its 2 workers
    stall = survived[0][0] - t_kill
    # the survivors' rank 0 took over the lock of the dead rank 0 on host 1 (same torchrun run)
    took = [s for t, s in h0.snapshot() if t >= t_kill and "took over the lock of an earlier attempt of this job" in s]
    assert took and f"on host {names[1]}" in took[0], logs
    # host 0's agent re-formed the world alone (one host: W = 2 ranks for n nodes) ...
    rdzv = [(t, int(m.group(1))) for t, s in h0.snapshot() if (m := re.search(r"group_world_size=(\d+)", s))]
    assert [w for t, w in rdzv if t_kill <= t < survived[0][0]] == [1], logs
    # ... and with both hosts when host 1 came back
    back = [t for t, w in rdzv if t >= t_back and w == 2]
    assert back, f"the run ended before host 1 was back\n{logs}"
    both = h1b.rounds(since=back[0])    # rank 0 is on host 1 again
    assert both and both[-1][1] == K and not h0.rounds(since=back[0]), logs
    rejoin = both[0][0] - t_back
    assert_same_outputs(tmp_path / "cut", ref, range(n))
    print(f"elastic test ({n} seats, 2 hosts x 2 ranks): {t_end - t0:.1f} s (reference {t_ref - t0:.1f} s); killed host 1 after round {KILL_AT}: "
          f"the survivors completed round {survived[0][1]} {stall:.1f} s later; host 1 restarted after round "
          f"{survived[BACK_AFTER - 1][1]}: first round with both hosts (round {both[0][1]}) {rejoin:.1f} s later")
