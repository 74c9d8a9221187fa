"""Compressed consensus over real gloo process groups: the same arithmetic as the single-process
oracle (bit for bit, public copies included) at any placement, the optimum reached on 5 ranks,
and the compressed payload, scales included, is what crosses the loopback wire (counted in a
network namespace of the test's own, whose loopback carries nothing else)."""
import pytest
import torch

from admm_dist.engine.admm import ADMMConfig, ADMMEngine
from admm_dist.engine.comm import LocalCommunicator, make_communicator
from admm_dist.engine.comm import ProcessGroupCommunicator
from admm_dist.bench.comm_wire import interface_tx_bytes
from admm_dist.bench.launcher import launch_cpu
from admm_dist.engine.lsq import LeastSquares

from wire import launch_in_netns, wire_bytes

N, P, CALLS = 4, 1001, 3
SPECS = [("ring", "ring", 1, "int8"), ("coordinator", "ring", 1, "fp8"), ("gossip", "ring", 2, "int8"),
         ("decentralized", "chain", 1, "int8"), ("decentralized", "complete", 1, "fp8"),
         ("ring", "ring", 1, "int4"), ("decentralized", "ring", 1, "int4"), ("ring", "ring", 1, "bf16"),
         ("gossip", "chain", 2, "bf16")]


def _vec(node, call):
    return torch.randn(P, generator=torch.Generator().manual_seed(100 * call + node))


def _blocks_run(ctx, piece):
    out = {}
    for mode, topo, tau, compress in SPECS:
        comm = ProcessGroupCommunicator(mode=mode, n_nodes=N, topology=topo, gossip_steps=tau,
                                        timeout=ctx.timeout, compress=compress)
        if piece:   # many pieces a message: each encoded, sent and decoded while the next moves
            comm.coded_bytes = piece
        for call in range(CALLS):   # the public copies carry over from call to call
            vs = [_vec(node, call) for node in comm.nodes]
            comm.consensus_(vs)
        out[(mode, topo, tau, compress)] = {node: (v, comm.node_state(node))
                                            for node, v in zip(comm.nodes, vs)}
    return out


@pytest.mark.parametrize("world,piece", [(2, None), (3, None), (4, None), (3, 300), (4, 100)])
def test_compressed_consensus_is_the_oracles_bit_for_bit_on_any_number_of_ranks(world, piece):
    """The oracle sends each message whole; the ranks in pieces of ``piece`` bytes (a block or
    two at 100) or whole: the same bits either way."""
    res = launch_cpu(_blocks_run, world, piece, timeout_s=60)
    for spec in SPECS:
        mode, topo, tau, compress = spec
        oracle = LocalCommunicator(mode=mode, n_nodes=N, topology=topo, gossip_steps=tau, compress=compress)
        for call in range(CALLS):
            want = [_vec(node, call) for node in range(N)]
            oracle.consensus_(want)
        for r in range(world):
            for node, (v, state) in res[r][spec].items():
                assert torch.equal(v, want[node]), (spec, world, node)
                ref = oracle.node_state(node)
                assert state.keys() == ref.keys(), (spec, node)
                assert all(torch.equal(state[k], ref[k]) for k in ref), (spec, node)


LSQ = [("ring", "ring", "int8"), ("decentralized", "ring", "int8"), ("decentralized", "expander", "fp8"),
       ("ring", "ring", "int4"), ("decentralized", "ring", "int4"), ("coordinator", "ring", "bf16"),
       ("decentralized", "ring", "bf16")]
ROUNDS = 100


def _lsq(ctx):
    out = {}
    prob = LeastSquares(n_nodes=ctx.world_size, dim=15, rows=24, seed=11)
    for mode, topo, compress in LSQ:
        comm = make_communicator(mode, n_nodes=ctx.world_size, topology=topo, timeout=ctx.timeout,
                                 compress=compress)
        engine = ADMMEngine(comm, ADMMConfig(rho=1.0), [torch.zeros(15)])
        engine.run(prob.exact_xstep(), ROUNDS)
        out[(mode, topo, compress)] = (engine.x[0], engine.z[0], engine.history[-1].bytes_sent)
    return out


@pytest.mark.slow
def test_compressed_admm_reaches_the_optimum_on_five_ranks_as_the_oracle_does():
    n = 5
    res = launch_cpu(_lsq, n, timeout_s=120)
    prob = LeastSquares(n_nodes=n, dim=15, rows=24, seed=11)
    x_star = prob.optimum()
    for spec in LSQ:
        mode, topo, compress = spec
        oracle = ADMMEngine(LocalCommunicator(mode=mode, n_nodes=n, topology=topo, compress=compress),
                            ADMMConfig(rho=1.0), [torch.zeros(15) for _ in range(n)])
        oracle.run(prob.exact_xstep(), ROUNDS)
        for r in range(n):
            x, z, sent = res[r][spec]
            assert float((x.double() - x_star).norm() / x_star.norm()) <= 1e-5, (spec, r)
            assert torch.equal(x, oracle.x[r]) and torch.equal(z, oracle.z[r]), (spec, r)
            assert sent == oracle.history[-1].bytes_sent
            assert sent == [oracle.comm.analytic_bytes(15, i) for i in range(n)]


# every mode's fp32 payload ("none") too, and gossip's on an expander: the meter counts what
# crosses the wire whatever the payload, in one launch
WIRE = [(mode, "ring", compress) for mode in ("ring", "coordinator", "decentralized", "gossip")
        for compress in ("none", "int8", "fp8", "int4", "bf16")] + [("gossip", "expander", "none")]


def _wire(ctx, p):
    """Bytes on the loopback wire for one consensus_ (tests/wire.py), the analytic bytes and the
    meter's count, a row per cell. Run in a network namespace of its own (other jobs' loopback
    traffic once put a cell 2.48% over)."""
    out = []
    for mode, topo, compress in WIRE:
        comm = make_communicator(mode, n_nodes=ctx.world_size, topology=topo, timeout=ctx.timeout,
                                 compress=compress)
        v = torch.randn(p, generator=torch.Generator().manual_seed(ctx.rank))
        on_wire = wire_bytes(ctx, comm, [v])
        metered = comm.meter.total(node=ctx.rank, round=None).sent
        out.append([mode, topo, compress, on_wire,
                    sum(comm.analytic_bytes(p, r) for r in range(ctx.world_size)), metered])
    return out


@pytest.mark.skipif(interface_tx_bytes("lo") is None, reason="no loopback counters in /proc/net/dev")
def test_the_meter_counts_the_wire_bytes_and_int8_fp8_put_under_three_tenths_of_fp32_int4_under_015():
    p = 1 << 20   # 4 MiB of fp32 per node
    res = {tuple(row[:3]): row[3:] for row in launch_in_netns(_wire, 3, p, timeout_s=120)[0]}
    for key, (wire, analytic, _) in res.items():
        assert abs(wire / analytic - 1) <= 0.02, (key, wire, analytic)
    for mode, topo, compress in WIRE:
        wire, fp32 = res[(mode, topo, compress)][0], res[(mode, topo, "none")][0]
        print(f"{mode} {compress}: {wire} B on the wire, {wire / fp32:.3f} of fp32")
        if compress == "bf16":   # half the bytes and gloo's headers
            assert wire <= 0.51 * fp32, (mode, compress, wire, fp32)
        elif compress != "none":
            assert wire <= (0.15 if compress == "int4" else 0.30) * fp32, (mode, compress, wire, fp32)


BYTES = [(mode, topo, tau) for mode, topo, tau in [("ring", "ring", 1), ("coordinator", "ring", 1),
                                                   ("gossip", "chain", 2), ("decentralized", "complete", 1)]]


def _metered(ctx, p):
    """The consensus bytes this rank's node sent and received in one consensus_, per (mode, compress)."""
    out = {}
    for mode, topo, tau in BYTES:
        for compress in ("none", "bf16"):
            comm = make_communicator(mode, n_nodes=ctx.world_size, topology=topo, gossip_steps=tau,
                                     timeout=ctx.timeout, compress=compress)
            comm.consensus_([torch.randn(p, generator=torch.Generator().manual_seed(ctx.rank))])
            c = comm.meter.total(node=ctx.rank, phase="consensus")
            out[(mode, compress)] = (c.sent, c.recv, comm.analytic_bytes(p, ctx.rank))
    return out


@pytest.mark.parametrize("world,p", [(3, P), (4, 1000)])
def test_bf16_sends_exactly_half_the_fp32_bytes(world, p):
    """2 bytes a value and no scale: on every mode the metered consensus bytes of bf16 are half
    fp32's, exactly: what each node sends (the exact mean: for 3 nodes, or chunks of one length),
    and in all. The owner scheme sends each chunk of the change once and gets each chunk of the
    mean once: a ring all-reduce's bytes."""
    res = launch_cpu(_metered, world, p, timeout_s=60)
    for mode, _, _ in BYTES:
        for r in range(world):
            (sent32, _, an32), (sent16, _, an16) = res[r][(mode, "none")], res[r][(mode, "bf16")]
            assert sent16 == an16 and sent32 == an32, (mode, r)
            assert 2 * sent16 == sent32, (mode, r, sent16, sent32)
        recv = {c: sum(res[r][(mode, c)][1] for r in range(world)) for c in ("none", "bf16")}
        assert 2 * recv["bf16"] == recv["none"], (mode, recv)
        sent = {c: sum(res[r][(mode, c)][0] for r in range(world)) for c in ("none", "bf16")}
        print(f"{mode}: bf16 sends {sent['bf16']} B, fp32 {sent['none']} B: {sent['bf16'] / sent['none']}")


def _garbage(ctx, mode):
    """With the cycle collector off, on a real group: the tensors a consensus_ leaves to it, and
    whether a communicator dropped after use is freed at once."""
    import gc
    import weakref

    comm = make_communicator(mode, n_nodes=ctx.world_size, timeout=ctx.timeout, compress="int8")
    v = torch.randn(1 << 16)
    comm.consensus_([v])
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        comm.consensus_([v])
        dropped = weakref.ref(comm)
        del comm
        gc.collect()
        return sum(o.nbytes for o in gc.garbage if isinstance(o, torch.Tensor)), dropped() is None
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize("mode", ["ring", "decentralized"])
def test_a_relay_leaves_nothing_to_the_garbage_collector(mode):
    """The relay's callbacks work through a queue, not by calling each other, so no cycle keeps
    a communicator or its buffers alive after a call (8 ranks of the links benchmark, one
    communicator per case, once grew to 3 GB each and one was killed for memory)."""
    assert launch_cpu(_garbage, 3, mode, timeout_s=60) == {r: (0, True) for r in range(3)}
