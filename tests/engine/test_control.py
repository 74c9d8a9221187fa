"""Control agreement (admm_dist.engine.control): every rank gets the same answer, on the control
group and not through the communicator, with each wait bounded; one process answers alone."""
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from admm_dist.engine.comm import make_communicator
from admm_dist.engine.comm.communicator import CommError
from admm_dist.engine.control import Control, GroupControl, control_for
from admm_dist.bench.launcher import launch_cpu

N = 5   # nodes, on 3 ranks: blocks [0, 1], [2, 3], [4]


def _questions(ctx):
    comm = make_communicator("ring", n_nodes=N, timeout=ctx.timeout)
    control = control_for(ctx, comm.rank_blocks())
    r = ctx.rank
    table = control.table(torch.tensor([[float(node), 10.0 * node] for node in comm.nodes], dtype=torch.float64))
    answers = {
        "group_backend": dist.get_backend(ctx.control),
        "all_yes": control.all(True), "all_but_one": control.all(r != 1),
        "any_none": control.any(False), "any_one": control.any(r == 2),
        "min": control.min(10 + r), "max": control.max(10 + r),
        "where": control.nodes_where({node: node % 2 == 1 for node in comm.nodes}),
        "table": table.tolist(),
    }
    control.barrier()
    answers["metered"] = comm.meter.total().calls   # nothing of the above went through the communicator
    return answers


def test_every_rank_gets_the_same_answers_off_the_consensus_meter():
    res = launch_cpu(_questions, 3, timeout_s=60)
    for r in range(3):
        a = res[r]
        assert a["group_backend"] == "gloo"
        assert (a["all_yes"], a["all_but_one"], a["any_none"], a["any_one"]) == (True, False, False, True)
        assert (a["min"], a["max"]) == (10, 12)
        assert a["where"] == [1, 3]
        assert a["table"] == [[float(i), 10.0 * i] for i in range(N)]
        assert a["metered"] == 0


def test_one_process_answers_its_own_questions():
    c = Control([range(3)])
    assert c.all(True) and not c.all(False) and c.any(True) and not c.any(False)
    assert (c.min(4), c.max(4)) == (4, 4)
    assert c.nodes_where({0: True, 1: False, 2: True}) == [0, 2]
    rows = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int64)
    assert torch.equal(c.table(rows), rows)
    with pytest.raises(ValueError, match="control table takes"):
        c.table(torch.zeros(3, 17))          # not a few figures per node: data, for the communicator
    with pytest.raises(ValueError, match="control table takes"):
        c.table(torch.zeros(2, 1))           # rows for another block


def _silent_peer(ctx, said):
    control = GroupControl(ctx.control, [range(1), range(1, 2)], datetime.timedelta(seconds=2))
    if ctx.rank == 1:     # never answers within the bound: silent until rank 0 has given up (or 60 s)
        deadline = time.monotonic() + 60
        while not os.path.exists(said) and time.monotonic() < deadline:
            time.sleep(0.05)
        return "slept"
    try:
        control.any(True)
    except CommError as e:
        return str(e)
    finally:
        open(said, "w").close()
    return "answered"


def test_an_unanswered_question_fails_within_the_bound(tmp_path):
    t0 = time.monotonic()
    res = launch_cpu(_silent_peer, 2, str(tmp_path / "said"), timeout_s=30)
    assert time.monotonic() - t0 < 30
    assert res[0] == "rank 0: agreement between ranks timed out after 2s (Operation timed out!)", res[0]
