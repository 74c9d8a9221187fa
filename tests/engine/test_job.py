"""The roll call in a real TCPStore (one process, a client per rank as a job's ranks hold them):
every rank that leaves ends its answering thread at once, and a roll call names only the ranks
that neither answer nor left."""
import datetime

import torch.distributed as dist

from admm_dist.engine.job import RollCall


def _client(port):
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))


def _roll(port, rank, world, prefix):
    return RollCall(_client(port), _client(port), rank, world, prefix)


def test_a_rank_that_leaves_at_once_ends_its_thread_without_waiting_out_the_join():
    """The first call a rank answers is numbered when it joins, so a rank that leaves before its
    thread has run (a short job) wakes that thread with its own call; and a thread whose answers
    covered its own rank's last call (with a peer's) ends instead of waiting for the next. (Before
    either, leave() waited out its 5 s join at the end of about one launch in four.)"""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    for attempt in range(20):
        ranks = [_roll(master.port, r, 2, f"t{attempt}") for r in range(2)]
        for rc in ranks:
            rc.leave()
        assert not any(rc._thread.is_alive() for rc in ranks), attempt


def test_a_roll_call_names_the_ranks_that_neither_answer_nor_left():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    caller, answering, leaving = (_roll(master.port, r, 4, "calls") for r in range(3))   # rank 3: never here
    leaving.leave()
    assert caller.silent() == [3]
    answering.leave()
    caller.leave()
    assert not any(rc._thread.is_alive() for rc in (caller, answering, leaving))
