"""Seat groups: the placement of W = k x N ranks, and a local step's minibatch computed in parts by
the k ranks of a seat (real gloo groups, a real tiny Qwen3 with the B-only LoRA adapter)."""
import pytest
import torch
import torch.distributed as dist

from admm_dist.core.errors import UserError
from admm_dist.data.fitset import Example
from admm_dist.data.sampler import RoleBalancedSampler
from admm_dist.bench.launcher import launch_cpu
from admm_dist.engine.placement import Placement
from admm_dist.engine.seat_group import SeatGroup, check_micro_batches, parts
from admm_dist.model import batches as bt
from admm_dist.model import objectives as obj
from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
from admm_dist.demo.tiny import char_tokenizer, tiny_qwen3
from admm_dist.training.config import TrainConfig
from admm_dist.training.local_steps import LocalSteps
from admm_dist.training.state import NodeState

from wire import launch_in_netns


def test_placement_is_blocks_up_to_n_then_seat_groups_and_refuses_other_worlds():
    assert [list(b) for b in Placement(4, 2).rank_blocks()] == [[0, 1], [2, 3]]
    eight = Placement(4, 8)
    assert eight.k == 2 and eight.leaders == [0, 2, 4, 6]
    assert [list(b) for b in eight.rank_blocks()] == [[0], [0], [1], [1], [2], [2], [3], [3]]
    assert list(eight.seat_group(5)) == [4, 5] and list(Placement(4, 4).seat_group(3)) == [3]
    assert eight.describe().startswith("seat 0: ranks 0-1; seat 1: ranks 2-3")
    # what each rank holds of the backbone, said beside the map (measured bytes per rank)
    mib = 2 ** 20
    assert eight.backbone(mib, [mib / 2] * 8, sharded=True) == "backbone (1.0 MiB): sharded over the 2 ranks of " \
                                                               "each seat, each rank holding 0.50 of it"
    assert "holding 0.48 to 0.52 of it" in eight.backbone(100, [52, 48] * 4, sharded=True)
    assert eight.backbone(100, [100] * 8, sharded=False).endswith(": whole on every rank (2 ranks per seat; "
                                                                  "shard_backbone=true holds 1/2 each)")
    assert Placement(4, 2).backbone(100, [100] * 2, sharded=True).endswith("): whole on every rank")
    with pytest.raises(UserError, match=r"world size 6 for 4 seats: launch 4 or 8 ranks"):
        Placement(4, 6)
    with pytest.raises(UserError, match=r"launch 8 or 12 ranks"):
        Placement(4, 9)


def test_parts_are_contiguous_in_order_and_a_seat_group_needs_k_to_divide_them():
    assert parts(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(UserError, match="between 1 and batch_size"):
        parts([1, 2], 3)
    assert list(SeatGroup().my_parts(4)) == [0, 1, 2, 3]
    with pytest.raises(UserError, match="micro_batches=3 with 2 ranks per seat: set micro_batches to a multiple of 2"):
        check_micro_batches(3, 2)
    with pytest.raises(UserError, match="micro_batches=3 > batch_size=2"):
        TrainConfig(micro_batches=3, batch_size=2)


def _node(micro_batches):
    """A real tiny backbone with its adapter, 8 preference pairs with reference log-probs, a sampler."""
    tok = char_tokenizer()
    adapter = BOnlyLoRA(tiny_qwen3(len(tok), hidden=32, layers=2, heads=2, seed=3),
                        AdapterConfig(lora_rank=4, lora_alpha=8.0, lora_layers_last=2))
    with torch.no_grad():
        adapter.flat.normal_(0.0, 0.05)
    ocfg = obj.ObjectiveConfig(dpo_beta=0.5, kl_beta=0.05)
    rows = [Example(seat=0, role="Solver", anchor=f"q{i}", prompt=f"Q:{i}" + "x" * (i % 3),
                    target="yes" + "!" * (i % 2), rejected="no" + "." * (i % 3)) for i in range(8)]
    enc = bt.encode(tok, rows, ocfg)
    obj.precompute_reference(adapter.model, enc, batch_size=8, ref_context=adapter.disabled, pad_id=tok.pad_token_id)
    cfg = TrainConfig(batch_size=8, micro_batches=micro_batches, local_steps=3, grad_clip=1.0)
    opt = torch.optim.Adam([adapter.param], lr=1e-2, foreach=False)
    return cfg, adapter, ocfg, tok, NodeState(0, enc, RoleBalancedSampler(enc, 8, 11), opt)


def _x_step(ctx, micro_batches):
    """One x-step of the node; the seat group is every rank of the launch (k = world size)."""
    torch.set_num_threads(1)
    cfg, adapter, ocfg, tok, st = _node(micro_batches)
    k = ctx.world_size
    seat = SeatGroup(k, ctx.rank, dist.group.WORLD if k > 1 else None, ctx.timeout)
    steps = LocalSteps(cfg, adapter.model, adapter, ocfg, tok.pad_token_id, seat)
    x = adapter.vector().clone()
    centre = x + 0.01
    loss = steps.run(st, x, centre, rho=0.5)
    return x, loss


@pytest.mark.parametrize("k", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_an_x_step_in_micro_batches_is_the_same_bits_on_one_and_on_k_ranks(k):
    """M = 4 parts: computed all by one rank, or M / k each by k ranks, then summed in part
    order: the same x and loss, bit for bit; and within float rounding of the same x-step in
    one piece (M = 1)."""
    torch.set_num_threads(1)
    x1, loss1 = _x_step(_One(), 4)
    res = launch_cpu(_x_step, k, 4, timeout_s=120)
    for r in range(k):
        assert torch.equal(res[r][0], x1) and res[r][1] == loss1, (k, r)
    whole, loss_whole = _x_step(_One(), 1)
    assert not torch.equal(whole, x1)   # a different sum order: another setting, other bits
    assert torch.allclose(whole, x1, rtol=0, atol=1e-5) and abs(loss_whole - loss1) < 1e-5


class _One:
    """One process: a world of one rank."""
    rank, world_size, timeout = 0, 1, None


MODES = [("ring", "ring", "none"), ("coordinator", "ring", "none"), ("gossip", "chain", "none"),
         ("decentralized", "ring", "none"), ("ring", "ring", "int8")]


def _lsq(comm, seat, n):
    from admm_dist.engine.admm import ADMMConfig, ADMMEngine
    from admm_dist.engine.lsq import LeastSquares

    prob = LeastSquares(n_nodes=n, dim=15, rows=24, seed=11)
    engine = ADMMEngine(comm, ADMMConfig(rho=1.0), [torch.zeros(15) for _ in comm.nodes], seat=seat)
    step = prob.exact_xstep()
    for _ in range(25):
        engine.step(step)
    return [z.clone() for z in engine.z], [u.clone() for u in engine.u], engine.history[-1].as_dict()


def _seat_groups(ctx):
    from admm_dist.engine.comm import make_communicator
    from admm_dist.engine.dist import build_mesh

    placement = Placement(4, ctx.world_size)
    mesh = build_mesh(placement, ctx)
    seat = mesh.seat
    out = {}
    for mode, topology, compress in MODES:
        comm = make_communicator(mode, n_nodes=4, topology=topology, compress=compress, timeout=ctx.timeout,
                                 group=mesh.across)
        out[(mode, compress)] = (list(comm.nodes), seat.leads) + _lsq(comm, seat, 4)
    return out


@pytest.mark.slow
def test_four_seats_on_eight_ranks_run_the_oracles_admm_with_the_leaders_carrying_the_consensus():
    """N = 4 seats, k = 2 ranks each: the leaders run the consensus among seats and give z to
    their group; every rank ends with the oracle's z and u (bit for bit; coordinator to float
    round-off), and every rank holds the same telemetry."""
    from admm_dist.engine.comm import LocalCommunicator

    res = launch_cpu(_seat_groups, 8, timeout_s=180)
    for mode, topology, compress in MODES:
        zs, us, rec = _lsq(LocalCommunicator(mode=mode, n_nodes=4, topology=topology, compress=compress),
                           SeatGroup(), 4)
        for r in range(8):
            nodes, leads, z, u, last = res[r][(mode, compress)]
            assert nodes == [r // 2] and leads == (r % 2 == 0)
            if mode == "coordinator":
                assert (z[0] - zs[r // 2]).norm() <= 1e-6 * zs[r // 2].norm()
            else:
                assert torch.equal(z[0], zs[r // 2]) and torch.equal(u[0], us[r // 2]), (mode, compress, r)
            assert last["bytes_sent"] == rec["bytes_sent"], (mode, compress, r)


def _seat_wire(ctx, p):
    """Rank 0's loopback bytes of one round's communication (the leaders' ring, then each leader's
    broadcast of z to its group) and the meter's count of it, summed over ranks."""
    from admm_dist.bench.comm_wire import interface_tx_bytes
    from admm_dist.engine.comm import CONSENSUS, make_communicator
    from admm_dist.engine.dist import build_mesh
    from admm_dist.engine.seat_group import SEAT

    placement = Placement(2, ctx.world_size)
    mesh = build_mesh(placement, ctx)
    seat = mesh.seat
    comm = make_communicator("ring", n_nodes=2, timeout=ctx.timeout, group=mesh.across)
    v = torch.randn(p, generator=torch.Generator().manual_seed(ctx.rank))

    def round_():
        if seat.leads:
            comm.consensus_([v])
        seat.broadcast([v], comm.meter, comm.nodes[0])

    round_()                      # gloo sets its connections up lazily
    comm.meter.reset()
    deltas = {False: [], True: []}
    for _ in range(3):            # the smallest reading with the round minus the smallest without
        for with_round in (False, True):
            dist.barrier()
            before = interface_tx_bytes("lo") if ctx.rank == 0 else 0
            dist.barrier()
            if with_round:
                round_()
            dist.barrier()
            deltas[with_round].append((interface_tx_bytes("lo") if ctx.rank == 0 else 0) - before)
    metered = torch.tensor([float(comm.meter.total(phase=CONSENSUS).sent + comm.meter.total(phase=SEAT).sent)])
    dist.all_reduce(metered)
    return min(deltas[True]) - min(deltas[False]), float(metered) / 3


def test_the_meter_counts_the_seat_groups_bytes_that_cross_the_loopback_wire():
    """2 seats on 4 gloo ranks: the leaders' ring and the broadcasts of z to the groups put on the
    wire what the meter counts (phases consensus and seat_group), within 2%."""
    from admm_dist.bench.comm_wire import interface_tx_bytes

    if interface_tx_bytes("lo") is None:
        pytest.skip("no loopback counters in /proc/net/dev")
    wire, metered = launch_in_netns(_seat_wire, 4, 1 << 20, timeout_s=60)[0]     # 4 MiB vectors, own loopback
    assert metered == 2 * (4 << 20) + 2 * (4 << 20)   # each leader: half of 4 MiB twice (ring), 4 MiB (broadcast)
    assert abs(wire / metered - 1) <= 0.02, (wire, metered)
