import pytest
import torch
import torch.distributed as dist

from admm_dist.engine.dist import backend_for, device_type, distributed, resolve_device
from admm_dist.engine.env import DistConfigError, read_env
from admm_dist.bench.launcher import launch_cpu


def test_without_torchrun_the_world_has_size_one():
    env = read_env({})
    assert (env.rank, env.world_size, env.local_rank, env.is_distributed, env.per_node) == (0, 1, 0, False, 1)
    with distributed("cpu", env=env) as ctx:
        assert ctx.backend is None and ctx.world_size == 1 and not dist.is_initialized()


def test_reads_torchrun_variables():
    env = read_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.local_rank, env.per_node) == (2, 4, 1, 4)
    assert env.master_addr == "127.0.0.1" and env.master_port == 29500
    two_hosts = read_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (two_hosts.local_world_size, two_hosts.per_node) == (2, 2)


@pytest.mark.parametrize("env,match", [
    ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "outside"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    ({"WORLD_SIZE": "two"}, "not an integer"),
    ({"WORLD_SIZE": "0"}, ">= 1"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "LOCAL_WORLD_SIZE=3"),
])
def test_inconsistent_environment_is_a_clear_error(env, match):
    with pytest.raises(DistConfigError, match=match):
        read_env(env)


def test_backend_is_chosen_from_the_device_in_one_place():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    with pytest.raises(DistConfigError, match="use cpu or cuda"):
        backend_for(torch.device("meta"))
    assert resolve_device("cpu").type == "cpu" and device_type("cuda:1") == "cuda"
    if not torch.cuda.is_available():
        assert resolve_device("auto").type == "cpu" and device_type("auto") == "cpu"
        with pytest.raises(DistConfigError, match="--device cpu"):
            resolve_device("cuda")


def test_timeout_must_be_positive():
    with pytest.raises(DistConfigError, match="timeout"):
        with distributed("cpu", timeout_s=0, env=read_env({})):
            pass


def _setup_and_fail(timeout_s):
    """Inside distributed(): a real gloo group; an exception must still tear it down."""
    seen = {}
    try:
        with distributed("cpu", timeout_s=timeout_s) as ctx:
            seen["backend"] = ctx.backend
            seen["world"] = dist.get_world_size()
            seen["timeout"] = ctx.timeout.total_seconds()
            t = torch.ones(3) * (ctx.rank + 1)
            dist.all_reduce(t)
            seen["sum"] = t.tolist()
            raise RuntimeError("boom")
    except RuntimeError as e:
        seen["error"] = str(e)
    seen["initialized_after"] = dist.is_initialized()
    # A second set-up in the same process works: the first group was destroyed.
    with distributed("cpu", timeout_s=timeout_s) as ctx:
        t = torch.ones(1)
        dist.all_reduce(t)
        seen["second_sum"] = t.item()
    seen["initialized_end"] = dist.is_initialized()
    return seen


def test_process_group_is_torn_down_on_failure_and_success():
    out = launch_cpu(_setup_and_fail, 2, 30.0, setup=False, timeout_s=30)
    for r in (0, 1):
        s = out[r]
        assert s["backend"] == "gloo" and s["world"] == 2 and s["timeout"] == 30.0
        assert s["sum"] == [3.0, 3.0, 3.0]
        assert s["error"] == "boom"
        assert s["initialized_after"] is False
        assert s["second_sum"] == 2.0
        assert s["initialized_end"] is False


def _as_caller(state, target, *args):
    """In a process of the fork server: this test's state (not the one the server started
    with), then ``target(*args)``."""
    from admm_dist.training import workers

    workers.adopt(state)
    target(*args)


def _spawned(target, each_args, gets, timeout_s):
    """``gets`` results from fresh processes, one per args tuple of ``each_args``, each
    ``target(*args, out)``; every process is joined (killed when stuck) on the way out; the
    processes' exit codes come with the results. They are forked from the process's fork
    server (torch imported there once, not once a process), as this process."""
    from admm_dist.training import workers

    ctx = workers.context()
    out = ctx.Queue()
    state = workers.caller_state()
    procs = [ctx.Process(target=_as_caller, args=(state, target, *args, out)) for args in each_args]
    for p in procs:
        p.start()
    try:
        got = [out.get(timeout=timeout_s) for _ in range(gets)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return got, [p.exitcode for p in procs]


def _agent_store_rank(rank, port, restart_count, out):
    """One worker of a torchrun job whose agent keeps the store across rendezvous rounds."""
    import os
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT=str(restart_count))
    torch.set_num_threads(1)
    with distributed("cpu", timeout_s=20) as ctx:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        out.put((rank, t.item(), ctx.world_size))


def test_ranks_of_a_new_round_agree_on_a_key_space_whatever_their_restart_counts():
    """torchrun's shared store outlives a round; after a host left or came back, the agents'
    restart counts differ (pytorch#135712) and a dead round's keys are still there. The ranks
    must still meet in one fresh key space, and a stale join of the dead round must not count."""
    import socket

    from admm_dist.engine.dist import agree_generation  # noqa: F401  (the protocol under test)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=__import__("datetime").timedelta(seconds=20))
    # What a dead round left: a join that nobody will confirm, a drawn generation, and the
    # init keys of that round's group.
    store.set("admm_dist/agree/w2/join/1", "0" * 32)
    store.add("admm_dist/generation", 4)
    store.set("admm_dist/gen_4/rank_0/addr", "10.9.9.9:1")
    got, codes = _spawned(_agent_store_rank, [(0, port, 0), (1, port, 3)], 2, 60)
    assert sorted(got) == [(0, 3.0, 2), (1, 3.0, 2)]
    assert codes == [0, 0]
    assert int(store.add("admm_dist/generation", 0)) == 5   # one fresh generation, drawn once
    assert store.check(["admm_dist/agree/w2/ack/5/1"])


# gloo's own texts (torch 2.13), its advice and its sign-off included
GLHF = ("Check the logs of the remote worker before reporting an error. "
        "GLHF! \N{BEACH WITH UMBRELLA}\N{VARIATION SELECTOR-16}")
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               f"[127.0.0.1]:54947. This is typically caused by a remote worker crashing. {GLHF}")
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:29862: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              f"application. {GLHF}")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "20000ms for recv operation to complete")


def test_a_backend_error_is_shortened_to_its_cause_without_the_noise():
    from admm_dist.engine.comm.communicator import first_line

    assert first_line(RuntimeError(GLOO_CLOSED)) == "Connection closed by peer [127.0.0.1]:54947"
    assert first_line(RuntimeError(GLOO_RESET)) == "Read error [127.0.0.1]:29862: Connection reset by peer"
    assert first_line(RuntimeError(GLOO_TIMEOUT)) == "Timed out waiting 20000ms for recv operation to complete"
    assert first_line(RuntimeError("Operation timed out!\nsecond line")) == "Operation timed out!"
    assert first_line(RuntimeError("")) == "RuntimeError"


def test_only_the_backends_own_failures_are_taken_for_a_lost_peer():
    """The one place that tells a peer that went away from a bug, which keeps its traceback."""
    from admm_dist.engine.comm.communicator import CommError
    from admm_dist.engine.dist import backend_failure

    for lost in (RuntimeError(GLOO_CLOSED), RuntimeError(GLOO_RESET), RuntimeError(GLOO_TIMEOUT),
                 dist.DistBackendError("NCCL communicator was aborted"), dist.DistNetworkError("recv failed"),
                 dist.DistStoreError("timeout")):
        assert backend_failure(lost), lost
    for bug in (RuntimeError("boom"), RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
                ValueError(GLOO_CLOSED), KeyError("x"), CommError("rank 0: ring failed")):
        assert not backend_failure(bug), bug


def _a_bug_then_a_peer_that_leaves(rank, port, out):
    """A worker of a job whose agent keeps the store (here, the test's): in a first group rank 0
    meets a bug; in a second, rank 1 leaves at once and rank 0 runs a collective the consensus
    transport does not wrap (a plain all_reduce, as FSDP's gathers are)."""
    import os

    from admm_dist.engine.comm.communicator import CommError

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    got = []
    for what in ("bug", "collective"):
        try:
            with distributed("cpu", timeout_s=20):
                if rank == 1:
                    if what == "collective":
                        os._exit(0)
                    continue
                if what == "bug":
                    raise RuntimeError("boom")
                dist.all_reduce(torch.ones(4))
        except RuntimeError as e:   # CommError is one too
            got.append((type(e) is CommError, type(e).__name__, str(e)))
    out.put(got)


def test_a_collective_whose_peer_left_leaves_distributed_as_one_line_and_a_bug_as_itself():
    import datetime

    from admm_dist.engine.env import DistEnv
    from admm_dist.engine.job import FirstFailure

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=20))
    (got,), _ = _spawned(_a_bug_then_a_peer_that_leaves, [(0, store.port), (1, store.port)], 1, 90)
    (bug_is_comm, bug_type, bug), (is_comm, _, msg) = got
    assert (bug_is_comm, bug_type, bug) == (False, "RuntimeError", "boom")
    assert is_comm and msg.startswith("rank 0: a collective between ranks failed ("), msg
    assert "\n" not in msg and "GLHF" not in msg and "pair.cc" not in msg, msg
    # claimed as the job's first failure before the group went: the agent's store holds it
    env = DistEnv(rank=1, world_size=2, master_addr="127.0.0.1", master_port=store.port, agent_store=True)
    assert FirstFailure(env).recorded() == (0, msg)
