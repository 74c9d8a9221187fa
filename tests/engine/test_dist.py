import pytest
import torch
import torch.distributed as dist

from admm_dist.engine.dist import DistConfigError, backend_for, distributed, read_env, resolve_device
from admm_dist.engine.launcher import launch_cpu


def test_without_torchrun_the_world_has_size_one():
    env = read_env({})
    assert (env.rank, env.world_size, env.local_rank, env.is_distributed) == (0, 1, 0, False)
    with distributed("cpu", env=env) as ctx:
        assert ctx.backend is None and ctx.world_size == 1 and not dist.is_initialized()


def test_reads_torchrun_variables():
    env = read_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.local_rank) == (2, 4, 1)
    assert env.master_addr == "127.0.0.1" and env.master_port == 29500


@pytest.mark.parametrize("env,match", [
    ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "outside"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    ({"WORLD_SIZE": "two"}, "not an integer"),
    ({"WORLD_SIZE": "0"}, ">= 1"),
])
def test_inconsistent_environment_is_a_clear_error(env, match):
    with pytest.raises(DistConfigError, match=match):
        read_env(env)


def test_backend_is_chosen_from_the_device_in_one_place():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    with pytest.raises(DistConfigError, match="use cpu or cuda"):
        backend_for(torch.device("meta"))
    assert resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        assert resolve_device("auto").type == "cpu"
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
    import multiprocessing as mp
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
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_agent_store_rank, args=(r, port, rc, out)) for r, rc in ((0, 0), (1, 3))]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    assert got == [(0, 3.0, 2), (1, 3.0, 2)]
    assert [p.exitcode for p in procs] == [0, 0]
    assert int(store.add("admm_dist/generation", 0)) == 5   # one fresh generation, drawn once
    assert store.check(["admm_dist/agree/w2/ack/5/1"])
