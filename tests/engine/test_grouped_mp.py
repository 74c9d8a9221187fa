"""NCCL's way of posting a step, run on gloo: each step's messages held and posted as one
``batch_isend_irecv``, matched by their order between two ranks (tags ignored, as NCCL ignores
them: on gloo the grouped path posts every message with tag 0). For every mode and payload, on
3 and 4 ranks of N = 4 nodes (several messages between one pair of ranks when W < N) and with
coded messages in many pieces, the result and the public copies are the per-message path's bit
for bit, and the single-process oracle's."""
import pytest
import torch

from admm_dist.engine.comm import LocalCommunicator, ProcessGroupCommunicator
from admm_dist.bench.launcher import launch_cpu

N, P, CALLS = 4, 1001, 2
MODES = [("coordinator", "ring", 1), ("ring", "ring", 1), ("gossip", "ring", 2), ("decentralized", "complete", 1)]
PAYLOADS = ["none", "int8", "int4", "fp8", "bf16"]
PIECES = [None, 100]   # coded messages whole (up to 1 MiB a piece) or in pieces of 100 bytes


def _vec(node, call):
    return torch.randn(P, generator=torch.Generator().manual_seed(100 * call + node))


def _run(ctx):
    out = {}
    for (mode, topo, tau) in MODES:
        for compress in PAYLOADS:
            for piece in PIECES if compress != "none" else [None]:
                for grouped in (False, True):
                    comm = ProcessGroupCommunicator(mode=mode, n_nodes=N, topology=topo, gossip_steps=tau,
                                                    timeout=ctx.timeout, compress=compress, grouped=grouped)
                    if piece:
                        comm.coded_bytes = piece
                    for call in range(CALLS):
                        vs = [_vec(node, call) for node in comm.nodes]
                        comm.consensus_(vs)
                    out[(mode, topo, tau, compress, piece, grouped)] = {
                        node: (v, comm.node_state(node)) for node, v in zip(comm.nodes, vs)}
    return out


@pytest.mark.parametrize("world", [3, 4])   # uneven blocks (2, 1, 1) and one node per rank
def test_the_grouped_step_is_the_per_message_paths_bit_for_bit_for_every_mode_and_payload(world):
    res = launch_cpu(_run, world, timeout_s=60)
    for (mode, topo, tau) in MODES:
        for compress in PAYLOADS:
            oracle = LocalCommunicator(mode=mode, n_nodes=N, topology=topo, gossip_steps=tau, compress=compress)
            for call in range(CALLS):
                want = [_vec(node, call) for node in range(N)]
                oracle.consensus_(want)
            for piece in PIECES if compress != "none" else [None]:
                spec = (mode, topo, tau, compress, piece)
                for r in range(world):
                    grouped, apart = res[r][spec + (True,)], res[r][spec + (False,)]
                    assert grouped.keys() == apart.keys()
                    for node, (v, state) in grouped.items():
                        v0, state0 = apart[node]
                        assert torch.equal(v, v0), (spec, world, node)
                        assert state.keys() == state0.keys() and all(torch.equal(state[k], state0[k]) for k in state)
                        if (mode, compress) == ("coordinator", "none"):   # the backend's sum over ranks
                            assert torch.allclose(v, want[node], rtol=0, atol=1e-6), (spec, node)
                        else:
                            assert torch.equal(v, want[node]), (spec, world, node)
