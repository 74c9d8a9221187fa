"""Two SLURM nodes on one host: each slurmd in its own network + UTS + mount namespace, joined
by a veth pair (tests/cluster.py). launch/slurm.sbatch runs 2 nodes x 2 ranks = 4 seats over
the veth (gloo), is preempted by USR2 (forwarded on both nodes), requeued, resumes, and ends
bit-identical to an uninterrupted run on one host. Its elastic form (``MIN_NODES=1 MAX_RESTARTS=3``,
``sbatch --no-kill``) loses node b (its torchrun agent and workers SIGKILLed by PID mid-run): node a
goes on alone with all four seats and the job completes, again bit-identical.

Slow (``python3 -m pytest -m slow tests/launch/test_multinode.py``); needs root, slurm-wlm, iproute2
and util-linux (ip, nsenter, unshare), and permission to create network namespaces.
"""
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster import (
    ELASTIC_ARGS,
    REPO,
    SCRIPT,
    Cluster,
    NetnsPair,
    Node,
    assert_same_outputs,
    has_checkpoint,
    log_of,
    missing,
    netns_missing,
    pids_of,
    reference,
    submit_dir,
    tiny_assets,
    train_args,
    wait_for,
)
from procs import kill_at_once

N = 4        # seats: 2 nodes x 2 ranks
K = 20

pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing() is not None, reason=str(missing()))]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"), N)


@pytest.fixture
def two_nodes(tmp_path):
    why = netns_missing()
    if why:
        pytest.skip(why)
    names = ["nodea", "nodeb"]   # hostnames inside the UTS namespaces only
    with NetnsPair() as net:
        hosts = net.hosts_file(tmp_path, names)
        c = Cluster(tmp_path / "slurm",
                    nodes=[Node(names[i], net.addr[i], net.prefix(i, names[i], hosts)) for i in (0, 1)],
                    ctld_host=names[0], ctld_addr=net.addr[0], ctld_prefix=net.prefix(0, names[0], hosts),
                    client_prefix=net.exec_prefix(0))
        try:
            c.start()
            yield c, net, names
        finally:
            c.stop()


@pytest.mark.timeout(600)
def test_two_nodes_preempted_requeued_match_an_uninterrupted_run(two_nodes, assets, tmp_path):
    t0 = time.monotonic()
    cluster, net, names = two_nodes
    sub = submit_dir(tmp_path)
    env = dict(NPROC_PER_NODE="2", VENV=sys.prefix, GLOO_SOCKET_IFNAME=net.ifname[0], OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    job = cluster.sbatch(SCRIPT, ["admm_dist.train"] + train_args(assets, sub / "cut", k_outer=K),
                         options=["--nodes=2"], cwd=str(sub), env=env)
    try:
        wait_for(lambda: has_checkpoint(sub / "cut") or cluster.state(job) not in ("PENDING", "RUNNING", ""),
                 300, "the first checkpoint of the two-node job")
    except TimeoutError:
        pytest.fail(f"no checkpoint: {cluster.job(job)}\n{log_of(sub, job)[-3000:]}")
    assert has_checkpoint(sub / "cut"), log_of(sub, job)[-3000:]
    pids = [p.name for p in pids_of(sub, job)]
    assert sorted(p.split("-rank")[0] for p in pids) == [names[0]] * 2 + [names[1]] * 2, pids
    t_usr2 = time.monotonic()
    cluster.signal_batch(job)
    # the reference (this host, uninterrupted, same config) meanwhile: the job stops, then waits
    # out its requeue (AuthInfo=cred_expire) before it starts again
    with ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(reference, assets, sub / "ref", k_outer=K)
        info = cluster.wait_done(job, 400)
        t_done = time.monotonic()
        ref = uninterrupted.result()
    log = log_of(sub, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", (info, log[-3000:])
    # every worker on both nodes was asked, by each node's pid files: each node reads all of
    # its own before it signals any, and both signal on one go from the batch shell (the ranks
    # leave together once one of them has the warning, removing their pid files)
    assert f"SIGUSR2: asked {N} worker(s) of job {job} " in log, log[-3000:]
    assert "without the go" not in log, log[-3000:]   # both nodes asked theirs on the one go
    assert log.count(f"on {names[0]},{names[1]}: 2 node(s) x 2 rank(s) = 4 rank(s); rendezvous {net.addr[0]}:") == 2
    assert "preempted after round" in log and "requeueing job" in log and "continuing after round" in log
    assert "Traceback" not in log
    assert_same_outputs(sub / "cut", ref, range(N))
    print(f"two-node test: {time.monotonic() - t0:.1f} s: USR2 at {t_usr2 - t0:.1f} s, done at {t_done - t0:.1f} s")


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(600)
def test_elastic_job_goes_on_on_one_node_when_the_other_is_lost(two_nodes, assets, tmp_path):
    t0 = time.monotonic()
    cluster, net, names = two_nodes
    sub = submit_dir(tmp_path)
    k = ELASTIC_ARGS["k_outer"]
    conf = "join_timeout=120,last_call_timeout=3,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
    env = dict(NPROC_PER_NODE="2", VENV=sys.prefix, GLOO_SOCKET_IFNAME=net.ifname[0], OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO), MIN_NODES="1", MAX_RESTARTS="3", RDZV_CONF=conf, PYTHONUNBUFFERED="1")
    # the reference first, on this host uninterrupted (the job's rounds must not race it); the
    # same run as test_elastic.py's, shared when both tests run in one process
    ref = reference(assets, sub / "ref", **ELASTIC_ARGS)
    job = cluster.sbatch(SCRIPT, ["admm_dist.train"] + train_args(assets, sub / "cut", **ELASTIC_ARGS),
                         options=["--nodes=2", "--no-kill"], cwd=str(sub), env=env)

    def rounds():
        return [int(m) for m in re.findall(r"^round +(\d+)/", log_of(sub, job), re.M)]

    try:
        wait_for(lambda: max(rounds(), default=0) >= 4 or cluster.state(job) not in ("PENDING", "RUNNING", ""),
                 300, "round 4 of the two-node job")
    except TimeoutError:
        pytest.fail(f"no round 4: {cluster.job(job)}\n{log_of(sub, job)[-3000:]}")
    b_workers = [int(p.read_text().strip()) for p in pids_of(sub, job) if p.name.startswith(names[1])]
    assert len(b_workers) == 2, (pids_of(sub, job), cluster.job(job), log_of(sub, job)[-3000:])
    agent = {_ppid(w) for w in b_workers}
    assert len(agent) == 1, agent
    victims = sorted(agent) + b_workers      # node b's torchrun agent (the srun task) and its workers
    at = len(log_of(sub, job))
    t_kill = time.monotonic()
    kill_at_once(victims)

    def resumed_round():   # node a's restarted workers resumed, then completed a round
        after = log_of(sub, job)[at:].split("resume auto: continuing after round", 1)
        return len(after) == 2 and re.search(r"^round +\d+/", after[1], re.M)

    try:
        wait_for(lambda: resumed_round() or cluster.state(job) not in ("PENDING", "RUNNING", ""),
                 300, "a round on the surviving node")
    except TimeoutError as e:
        pytest.fail(f"{e}: {cluster.job(job)}\n{log_of(sub, job)[-3000:]}")
    t_first = time.monotonic()
    info = cluster.wait_done(job, 400)
    log = log_of(sub, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log[-3000:])
    assert "elastic: torchrun --nnodes 1:2 --max-restarts 3" in log, log[-3000:]
    assert "is that of a node lost on the way: exiting 0" in log, log[-3000:]   # node b's task: SIGKILL
    assert re.search(rf"^round +{k}/{k} ", log, re.M), log[-3000:]
    assert_same_outputs(sub / "cut", ref, range(N))
    print(f"elastic SLURM test: {time.monotonic() - t0:.1f} s; node b lost after round 4: a round on node a "
          f"{t_first - t_kill:.1f} s later; the job's last line: {log.strip().splitlines()[-1]}")
