"""Several nodes per rank (N = 4 nodes on W = 1..4 gloo ranks, N = 6 on 4): every mode computes the
single-process oracle's result, bit for bit for ring and gossip, and meters in-process hops
apart from wire bytes."""
import pytest
import torch

from admm_dist.core.errors import UserError
from admm_dist.engine.comm import TOPOLOGIES, LocalCommunicator
from admm_dist.engine.comm import IN_PROCESS, ProcessGroupCommunicator
from admm_dist.engine.comm.meter import CONSENSUS
from admm_dist.engine.placement import blocks, owners
from admm_dist.bench.launcher import launch_cpu

N, P = 4, 1001          # P divisible by none of 2, 3, 4
SPECS = [("coordinator", "ring", 1), ("ring", "ring", 1)] + [("gossip", t, 2) for t in TOPOLOGIES]
SPECS += [("decentralized", t, 1) for t in TOPOLOGIES]


def _vec(node):
    return torch.randn(P, generator=torch.Generator().manual_seed(500 + node))


def _run(ctx, n=N):
    out = {}
    for mode, topo, tau in SPECS:
        comm = ProcessGroupCommunicator(mode=mode, n_nodes=n, topology=topo, gossip_steps=tau, timeout=ctx.timeout)
        vs = [_vec(node) for node in comm.nodes]
        comm.consensus_(vs)
        meter = {node: (comm.meter.total(node=node, phase=CONSENSUS).sent,
                        comm.meter.total(node=node, phase=IN_PROCESS).sent) for node in comm.nodes}
        rows = comm.gather_rows(torch.tensor([[float(node), 2.0 * node] for node in comm.nodes]))
        out[(mode, topo, tau)] = {"nodes": list(comm.nodes), "vs": vs, "meter": meter, "rows": rows}
    return out


def test_placement_is_contiguous_and_balanced():
    assert [list(b) for b in blocks(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert owners(5, 2) == [0, 0, 0, 1, 1]
    assert [list(b) for b in blocks(4, 4)] == [[0], [1], [2], [3]]
    with pytest.raises(UserError, match="world size 5 > number of nodes 4"):
        blocks(4, 5)


@pytest.mark.parametrize("n,world", [(N, 2), (N, 3), (N, 4), (6, 4)])   # W = 1 is the oracle itself
def test_every_mode_is_the_oracles_on_any_number_of_ranks(n, world):
    """N = 4 on 2, 3, 4 ranks, and N = 6 on 4 ranks (uneven blocks: 2, 2, 1, 1)."""
    res = launch_cpu(_run, world, n, timeout_s=60)
    for spec in SPECS:
        mode, topo, tau = spec
        oracle = LocalCommunicator(mode=mode, n_nodes=n, topology=topo, gossip_steps=tau)
        want = [_vec(node) for node in range(n)]
        oracle.consensus_(want)
        got = {}
        for r in range(world):
            part = res[r][spec]
            assert part["nodes"] == list(blocks(n, world)[r])
            got.update(zip(part["nodes"], part["vs"]))
            assert part["rows"].tolist() == [[float(i), 2.0 * i] for i in range(n)]
            for node, (wire, copied) in part["meter"].items():
                if mode != "coordinator":   # every byte the oracle's node sends: on the wire or copied
                    assert wire + copied == oracle.meter.total(node=node, phase=CONSENSUS).sent, (spec, node)
        for node in range(n):
            if mode == "coordinator":
                assert torch.allclose(got[node], want[node], rtol=0, atol=1e-6), spec
            else:
                assert torch.equal(got[node], want[node]), (spec, world, node)
