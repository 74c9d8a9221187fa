import pytest

from admm_dist.engine.comm import ByteMeter, chunk_bounds, chunk_sizes, ring_bytes_per_rank
from admm_dist.engine.comm.meter import CONSENSUS, TELEMETRY


@pytest.mark.parametrize("numel,n", [(10, 3), (1001, 4), (7, 7), (5, 8), (12, 4)])
def test_chunks_cover_the_vector(numel, n):
    sizes = chunk_sizes(numel, n)
    assert sum(sizes) == numel and max(sizes) - min(sizes) <= 1
    bounds = chunk_bounds(numel, n)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("numel,n", [(1001, 2), (1001, 3), (1001, 4), (4096, 4)])
def test_ring_bytes_match_the_analytic_payload_up_to_chunk_rounding(numel, n):
    analytic = 2 * (n - 1) / n * 4 * numel
    per_rank = [ring_bytes_per_rank(numel, n, r) for r in range(n)]
    assert all(abs(b - analytic) <= 2 * 4 for b in per_rank)
    # summed over ranks the rounding cancels: every chunk travels n-1 times per phase
    assert sum(per_rank) == 2 * (n - 1) * 4 * numel
    assert ring_bytes_per_rank(numel, 1, 0) == 0


def test_meter_totals_by_round_node_phase_primitive():
    m = ByteMeter()
    m.start_round(1)
    m.add(0, "isend", sent=100)
    m.add(0, "irecv", recv=40)
    m.add(1, "isend", sent=7)
    m.add(0, "all_gather", sent=8, recv=8, phase=TELEMETRY)
    m.start_round(2)
    m.add(0, "isend", sent=1)
    assert m.total(node=0, round=1, phase=CONSENSUS).sent == 100
    assert m.total(node=0, round=1, phase=CONSENSUS).recv == 40
    assert m.total(node=0).sent == 109
    assert m.total(primitive="isend").calls == 3
    gathered = m.total(node=0, round=1, primitive="all_gather")
    assert (gathered.sent, gathered.recv, gathered.calls) == (8, 8, 1)
    assert m.total(node=0, round=1, phase=TELEMETRY).sent == 8
