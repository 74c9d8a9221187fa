"""A real, throw-away SLURM cluster for tests (Debian's slurm-wlm 22.05, run as root).

``Cluster`` writes a private ``slurm.conf`` under a temp dir (auth/none + cred/none, so no
munge; proctrack/linuxproc + task/none, so no cgroups; free ports; state, spool, logs and
pid files all under that dir), starts ``slurmctld`` and one ``slurmd`` per node itself and
stops them by the PIDs it started, never by name. Clients get ``SLURM_CONF`` through
``env()``, so nothing here can reach, or be reached by, any other SLURM on the host.

Every wait is bounded. Jobs are polled with ``scontrol show job -o`` (``sbatch --wait``
notices a finished job only every ~32 s).

Nodes: by default one node named ``hostname -s``. For several nodes on one host, give each a
``Node`` with its own hostname/address and a ``prefix`` command that runs slurmd inside its
namespaces (see tests/launch/test_multinode.py); the address must be reachable from slurmctld.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from conftest import build_tiny, tiny_args

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}
BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "srun")


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def missing() -> Optional[str]:
    """Why a test cluster cannot run here (None: it can)."""
    lost = [b for b in BINARIES if _which(b) is None]
    if lost:
        return f"SLURM is not installed ({', '.join(lost)} missing): apt-get install -y slurm-wlm"
    if os.geteuid() != 0:
        return "the test cluster runs slurmd/slurmctld as root (SlurmUser=root): run the slow tests as root"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def wait_for(pred: Callable[[], object], timeout: float, what: str, every: float = 0.25):
    """Poll ``pred`` until truthy (returns its value) or raise TimeoutError naming ``what``."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(every)


def parse_fields(line: str) -> Dict[str, str]:
    """``Key=Value Key2=Value2 ...`` (one ``scontrol ... -o`` line) as a dict."""
    out: Dict[str, str] = {}
    for tok in line.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out.setdefault(k, v)
    return out


def stop_pid(pid: int, grace: float = 10.0) -> None:
    """SIGTERM then, after ``grace`` seconds, SIGKILL one PID we started."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:   # not our child: poll /proc
            done = 0 if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" else pid
        if done:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def environ_of(pid: int) -> Dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


@dataclass
class Node:
    name: str
    addr: str = ""            # NodeAddr (default: the name)
    prefix: Sequence[str] = ()  # command prefix to start this node's slurmd (e.g. nsenter ...)
    cpus: int = 8


@dataclass
class Cluster:
    root: Path
    nodes: List[Node] = field(default_factory=list)
    ctld_host: str = ""
    ctld_addr: str = ""
    extra_conf: str = ""
    ctld_prefix: Sequence[str] = ()     # command prefix for slurmctld (e.g. into a namespace)
    client_prefix: Sequence[str] = ()   # command prefix for sbatch/scontrol/scancel

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        host = socket.gethostname().split(".")[0]
        if not self.nodes:
            self.nodes = [Node(host)]
        self.ctld_host = self.ctld_host or host
        self.name = f"t{os.getpid()}x{int(time.time() * 1000) % 100000}"
        self.conf = self.root / "slurm.conf"
        self.procs: Dict[str, subprocess.Popen] = {}
        self.jobs: List[str] = []
        # slurmstepd's domain sockets live in the spool: a short folder of its own, as the
        # root's path (pytest's, longer under xdist) can pass the 108-byte socket path limit
        self.spool = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))

    # ------------------------------------------------------------ configuration
    def write_conf(self) -> None:
        r = self.root
        for d in ("state", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        for n in self.nodes:
            (self.spool / n.name).mkdir(parents=True, exist_ok=True)
        (r / "plugstack.conf").write_text("")
        self.ctld_port, self.slurmd_port = free_port(), free_port()
        while self.slurmd_port == self.ctld_port:
            self.slurmd_port = free_port()
        addr = f"({self.ctld_addr})" if self.ctld_addr else ""
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={self.ctld_host}{addr}",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            "CredType=cred/none",
            "AuthInfo=cred_expire=5",   # the least slurmctld takes: a requeued job waits it + 1 s
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "JobRequeue=1",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MinJobAge=600",
            "KillWait=5",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            "MessageTimeout=20",
            f"PlugStackConfig={r / 'plugstack.conf'}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={self.spool / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.spool / '%n' / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n.name} NodeAddr={n.addr or n.name} CPUs={n.cpus} State=UNKNOWN")
        names = ",".join(n.name for n in self.nodes)
        lines.append(f"PartitionName=t Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO")
        if self.extra_conf:
            lines.append(self.extra_conf)
        self.conf.write_text("\n".join(lines) + "\n")

    def env(self, **extra: str) -> Dict[str, str]:
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if k != "SLURM_CONF":
                del env[k]
        env.update(extra)
        return env

    # ------------------------------------------------------------ daemons
    def start(self, timeout: float = 60.0) -> "Cluster":
        self.write_conf()
        env = self.env()
        log = open(self.root / "log" / "daemons.out", "ab")
        self.procs["slurmctld"] = subprocess.Popen(
            list(self.ctld_prefix) + [_which("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)], env=env,
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: self._ctl_up(), timeout, "slurmctld to answer")
        for n in self.nodes:
            self.procs[f"slurmd:{n.name}"] = subprocess.Popen(
                list(n.prefix) + [_which("slurmd"), "-D", "-f", str(self.conf)], env=env,
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for(self._idle, timeout, f"nodes {[n.name for n in self.nodes]} to be idle")
        except TimeoutError as e:
            raise TimeoutError(f"{e}; slurmctld log tail:\n{self.log_tail('slurmctld.log')}") from None
        return self

    def _ctl_up(self) -> bool:
        dead = [k for k, p in self.procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead} exited; log:\n{self.log_tail('daemons.out')}"
                               f"\n{self.log_tail('slurmctld.log')}")
        r = self.run(["scontrol", "ping"], check=False)
        return r.returncode == 0 and "UP" in r.stdout

    def _idle(self) -> bool:
        self._ctl_up()
        r = self.run(["scontrol", "show", "node", "-o"], check=False)
        states = [parse_fields(line).get("State", "") for line in r.stdout.splitlines() if line.strip()]
        return len(states) == len(self.nodes) and all(s.split("+")[0] == "IDLE" for s in states)

    def log_tail(self, name: str, n: int = 3000) -> str:
        try:
            return (self.root / "log" / name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Cancel our jobs, wait (bounded) for them to end, then stop our daemons by PID."""
        try:
            live = [j for j in self.jobs if self.state(j) not in FINAL]
            if live and self._alive("slurmctld"):
                self.run(["scancel"] + live, check=False)
                try:
                    wait_for(lambda: all(self.state(j) in FINAL for j in live), 30, "cancelled jobs to end")
                except TimeoutError:
                    pass
        finally:
            for key in [k for k in self.procs if k.startswith("slurmd:")] + ["slurmctld"]:
                p = self.procs.get(key)
                if p is not None and p.poll() is None:
                    stop_pid(p.pid)
            self._sweep()
            shutil.rmtree(self.spool, ignore_errors=True)

    def _alive(self, key: str) -> bool:
        p = self.procs.get(key)
        return p is not None and p.poll() is None

    def _sweep(self) -> List[int]:
        """Kill what this cluster left behind: processes whose environment carries *our*
        SLURM_CONF (slurmstepd, job processes). That path is unique to this cluster, so no
        other process on the host can match."""
        mine = os.getpid()
        left = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == mine:
                continue
            if environ_of(int(d)).get("SLURM_CONF") == str(self.conf):
                left.append(int(d))
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ clients
    def run(self, cmd: Sequence[str], *, env: Optional[Dict[str, str]] = None, check: bool = True,
            timeout: float = 30.0, cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        cmd = list(self.client_prefix) + [_which(cmd[0]) or cmd[0]] + list(cmd[1:])
        r = subprocess.run(cmd, env=env or self.env(), capture_output=True, text=True, timeout=timeout, cwd=cwd)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} -> {r.returncode}: {r.stderr.strip()}")
        return r

    def sbatch(self, script: str, args: Iterable[str] = (), *, options: Iterable[str] = (),
               cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> str:
        r = self.run(["sbatch", "--parsable"] + list(options) + [script] + list(args),
                     env=self.env(**(env or {})), cwd=cwd)
        job = r.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job(self, job: str) -> Dict[str, str]:
        r = self.run(["scontrol", "show", "job", "-o", job], check=False)
        return parse_fields(r.stdout) if r.returncode == 0 else {}

    def state(self, job: str) -> str:
        return self.job(job).get("JobState", "")

    def wait_state(self, job: str, states: Iterable[str], timeout: float) -> Dict[str, str]:
        want = set(states)
        info: Dict[str, str] = {}

        def reached():
            nonlocal info
            info = self.job(job)
            return info.get("JobState") in want

        try:
            wait_for(reached, timeout, f"job {job} to reach {sorted(want)}", every=0.3)
        except TimeoutError as e:
            raise TimeoutError(f"{e} (now {info.get('JobState')}: {info.get('Reason')})") from None
        return info

    def wait_done(self, job: str, timeout: float) -> Dict[str, str]:
        return self.wait_state(job, FINAL, timeout)

    def signal_batch(self, job: str, sig: str = "USR2") -> None:
        """What SLURM's ``--signal=B:USR2@T`` does, now: signal the batch shell only."""
        self.run(["scancel", f"--signal={sig}", "--batch", job])


# ---------------------------------------------------------------- two "nodes" on one host
def netns_missing() -> Optional[str]:
    """Why two network namespaces cannot be made here (None: they can)."""
    for b in ("ip", "unshare", "nsenter"):
        if _which(b) is None:
            return f"{b} is not installed (iproute2 / util-linux)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"admmprobe{os.getpid()}"
    r = subprocess.run([_which("ip"), "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"network namespaces are not permitted here: ip netns add: {r.stderr.strip()}"
    subprocess.run([_which("ip"), "netns", "del", probe], capture_output=True, timeout=30)
    r = subprocess.run([_which("unshare"), "--uts", "--mount", "true"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"UTS/mount namespaces are not permitted here: unshare: {r.stderr.strip()}"
    return None


def _used_subnets() -> set:
    r = subprocess.run([_which("ip"), "-4", "-o", "addr"], capture_output=True, text=True, timeout=30)
    r2 = subprocess.run([_which("ip"), "-4", "route"], capture_output=True, text=True, timeout=30)
    used = set()
    for tok in (r.stdout + " " + r2.stdout).split():
        parts = tok.split("/")[0].split(".")
        if len(parts) == 4 and all(p.isdigit() for p in parts):
            used.add(tuple(int(p) for p in parts[:2]))
    return used


class NetnsPair:
    """Two network namespaces joined by a veth pair, names unique to this run; ``del`` on exit.

    ``addr[i]`` is namespace i's address, ``ifname[i]`` its veth (the same name in both, as a
    cluster's nodes share an interface name for GLOO_SOCKET_IFNAME), ``path[i]`` its netns file
    (for ``nsenter --net=``). ``prefix(i, hostname)``: a command prefix that runs a command in
    namespace i with its own hostname (UTS) and mount namespace, as slurmd needs; ``ip netns
    exec`` would remount /sys and hide the cgroup fs slurmd reads.
    """

    def __init__(self) -> None:
        import random

        tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
        self.ns = [f"admm{tag}a", f"admm{tag}b"]
        self.tmpname = [f"av{tag}a", f"av{tag}b"]         # in the host's namespace: unique, <= 15 characters
        self.ifname = ["admm0", "admm0"]                   # inside: one name on every "node", like eth0
        used = _used_subnets()
        free = [(10, b) for b in range(201, 255) if (10, b) not in used]
        if not free:
            raise RuntimeError("no free 10.201-254.x.x subnet for the veth pair")
        a, b = random.choice(free)
        c = random.randrange(1, 255)
        self.addr = [f"{a}.{b}.{c}.1", f"{a}.{b}.{c}.2"]
        self.path = [f"/run/netns/{n}" for n in self.ns]
        self.made: List[str] = []

    def _ip(self, *args: str) -> None:
        r = subprocess.run([_which("ip")] + list(args), capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    def __enter__(self) -> "NetnsPair":
        try:
            for n in self.ns:
                self._ip("netns", "add", n)
                self.made.append(n)
            self._ip("link", "add", self.tmpname[0], "type", "veth", "peer", "name", self.tmpname[1])
            for i in (0, 1):
                self._ip("link", "set", self.tmpname[i], "netns", self.ns[i])
                self._ip("-n", self.ns[i], "link", "set", self.tmpname[i], "name", self.ifname[i])
                self._ip("-n", self.ns[i], "addr", "add", f"{self.addr[i]}/24", "dev", self.ifname[i])
                self._ip("-n", self.ns[i], "link", "set", self.ifname[i], "up")
                self._ip("-n", self.ns[i], "link", "set", "lo", "up")
        except Exception:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for n in reversed(self.made):   # deleting a namespace deletes its end of the veth pair
            subprocess.run([_which("ip"), "netns", "del", n], capture_output=True, timeout=30)
        self.made = []
        # a pair made but not yet moved into the namespaces (a failed set-up): our unique name
        subprocess.run([_which("ip"), "link", "del", self.tmpname[0]], capture_output=True, timeout=30)

    def exec_prefix(self, i: int) -> List[str]:
        """Run in namespace i's network only (like ``ip netns exec`` without the /sys remount)."""
        return [_which("nsenter"), f"--net={self.path[i]}"]

    def hosts_file(self, folder: Path, names: Sequence[str]) -> Path:
        """An /etc/hosts for inside the namespaces: the node names resolve to the veth addresses."""
        path = Path(folder) / "hosts"
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{a} {n}" for a, n in zip(self.addr, names)]
        path.write_text("\n".join(lines) + "\n")
        return path

    def prefix(self, i: int, hostname: str, hosts: Optional[Path] = None) -> List[str]:
        """Namespace i's network, its own hostname and mount namespace (with ``hosts`` bound
        over /etc/hosts there, so node names resolve); the host's files are otherwise shared."""
        bind = f'mount --bind "{hosts}" /etc/hosts && ' if hosts else ""
        return self.exec_prefix(i) + [_which("unshare"), "--uts", "--mount", "--propagation", "private",
                                      "sh", "-c", bind + 'hostname "$0" && exec "$@"', hostname]


# ---------------------------------------------------------------- the tiny training job
REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "launch" / "slurm.sbatch")


_ASSETS: Dict[int, Dict[str, object]] = {}


def tiny_assets(folder: Path, n_agents: int) -> Dict[str, object]:
    """:func:`conftest.build_tiny`'s assets, built once per chain length in a test process (in
    ``folder`` the first time), so that test modules share them and with them
    :func:`reference`'s runs."""
    made = _ASSETS.get(n_agents)
    if made and os.path.exists(made["fit"]):
        return made
    _ASSETS[n_agents] = build_tiny(folder, n_agents)
    return _ASSETS[n_agents]


# the elastic tests' run (tests/launch/test_elastic.py, test_multinode.py; N = 4, 2 hosts x 2
# ranks): a host is lost once round 4 is logged (the kill lands in round 5 or 6: a round takes
# about 0.3 s on 2 cores, the tests look every 0.25 s) and, in test_elastic.py, brought back after
# 2 more, the survivors holding there until it is (tests/launch/held_train.py), so the rounds need
# not outlast the rejoin: 10 rounds leave some after the kill and after the rejoin, and short
# rounds keep the uninterrupted reference short.
ELASTIC_ARGS = dict(k_outer=10, local_steps=5, keep_checkpoints=3, quiet="false")

_REFERENCES: Dict[tuple, Path] = {}


def reference(assets: Dict[str, object], folder: Path, **kw) -> Path:
    """The uninterrupted run of ``train_args(assets, folder, **kw)`` on this host, in one process
    that holds every node (the numbers do not depend on the placement:
    tests/training/test_trainer.py), run once per setting in a test process: the folder to
    compare with :func:`assert_same_outputs`."""
    key = tuple(a for a in train_args(assets, Path("."), **kw) if not a.startswith(("out=", "report_dir=")))
    if key not in _REFERENCES or not (_REFERENCES[key] / "run-last.safetensors").exists():
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        p = subprocess.run([sys.executable, "-m", "admm_dist.train"] + train_args(assets, folder, **kw), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-3000:]
        _REFERENCES[key] = Path(folder)
    return _REFERENCES[key]


def train_args(assets: Dict[str, object], out: Path, **kw) -> List[str]:
    return tiny_args(assets, **dict(dict(k_outer=20, checkpoint_every=1, timeout_s=120, out=str(Path(out) / "run"),
                                         report_dir=str(Path(out) / "rep"), resume="auto"), **kw))


def submit_dir(folder: Path) -> Path:
    sub = Path(folder) / "submit"
    (sub / "logs").mkdir(parents=True)   # SLURM does not create the --output folder
    return sub


def log_of(sub: Path, job: str) -> str:
    p = Path(sub) / "logs" / f"admm_dist-{job}.out"
    return p.read_text(errors="replace") if p.exists() else ""


def pids_of(sub: Path, job: str) -> List[Path]:
    d = Path(sub) / "logs" / job / "pids"
    return sorted(d.glob("*.pid")) if d.is_dir() else []


def has_checkpoint(out: Path) -> bool:
    root = Path(out) / "run.ckpt"
    return root.is_dir() and any(p.name.startswith("round-") for p in root.iterdir())


def assert_same_outputs(a: Path, b: Path, nodes: Iterable[int]) -> None:
    """``-last.safetensors`` and every node file (x, z, u) equal bit for bit."""
    import torch
    from safetensors.torch import load_file

    la, lb = load_file(str(Path(a) / "run-last.safetensors")), load_file(str(Path(b) / "run-last.safetensors"))
    assert la.keys() == lb.keys()
    for k in la:
        assert torch.equal(la[k], lb[k]), k
    for n in nodes:
        fa = load_file(str(Path(a) / "run" / f"node-{n}.safetensors"))
        fb = load_file(str(Path(b) / "run" / f"node-{n}.safetensors"))
        assert fa.keys() == fb.keys() == {"x", "z", "u"}
        for k in fa:
            assert torch.equal(fa[k], fb[k]), (n, k)
