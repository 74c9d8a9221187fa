import pytest
import torch

from admm_dist.engine.comm import TOPOLOGIES, metropolis_weights, neighbours


def mixing_matrix(topology, n):
    """The dense n x n mixing matrix (float64) of the communicators' weights."""
    W = torch.zeros(n, n, dtype=torch.float64)
    for i, row in enumerate(metropolis_weights(neighbours(topology, n))):
        for j, w in row.items():
            W[i, j] = w
    return W


def is_connected(nbrs):
    seen, todo = {0}, [0]
    while todo:
        for j in nbrs[todo.pop()]:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    return len(seen) == len(nbrs)


# every graph at every size it exists for (a prime count > 3 has no grid: test_graph_shapes)
@pytest.mark.parametrize("topology,n", [(t, n) for t in TOPOLOGIES for n in [2, 3, 4, 5, 6, 8, 9, 12]
                                        if not (t == "grid" and n == 5)])
def test_mixing_matrix_is_symmetric_doubly_stochastic_and_connected(topology, n):
    W = mixing_matrix(topology, n)
    assert torch.allclose(W, W.T, atol=0)
    ones = torch.ones(n, dtype=torch.float64)
    assert torch.allclose(W @ ones, ones, atol=1e-12)
    assert torch.allclose(W.T @ ones, ones, atol=1e-12)
    assert (W >= 0).all()
    nbrs = neighbours(topology, n)
    assert is_connected(nbrs)
    # Off-diagonal support is exactly the edge set.
    for i in range(n):
        assert sorted(j for j in range(n) if j != i and W[i, j] > 0) == nbrs[i]
    # Connected + positive diagonal -> second largest |eigenvalue| < 1 (mixing converges).
    eig = torch.linalg.eigvalsh(W).abs().sort(descending=True).values
    assert eig[0] == pytest.approx(1.0, abs=1e-12)
    assert eig[1] < 1 - 1e-9


def test_graph_shapes():
    assert neighbours("ring", 4) == [[1, 3], [0, 2], [1, 3], [0, 2]]
    assert neighbours("ring", 2) == [[1], [0]]
    assert neighbours("chain", 4) == [[1], [0, 2], [1, 3], [2]]
    assert all(len(x) == 5 for x in neighbours("complete", 6))
    # exponential graph on 8 nodes: +-1, +-2, +-4 -> degree 5
    assert neighbours("expander", 8)[0] == [1, 2, 4, 6, 7]
    # 2 x 3 grid without wrap-around
    assert neighbours("grid", 6) == [[1, 3], [0, 2, 4], [1, 5], [0, 4], [1, 3, 5], [2, 4]]
    # a prime count has no grid: refused with the fix, not silently a chain (2, 3 are 1 x n)
    with pytest.raises(ValueError, match="5 is prime.*topology ring or chain"):
        neighbours("grid", 5)
    assert neighbours("grid", 3) == neighbours("chain", 3)


def test_metropolis_weights_values():
    W = mixing_matrix("chain", 3)
    # degrees 1,2,1: W01 = W12 = 1/3; W00 = 2/3, W11 = 1/3
    assert W[0, 1] == pytest.approx(1 / 3)
    assert W[0, 0] == pytest.approx(2 / 3)
    assert W[1, 1] == pytest.approx(1 / 3)
    W = mixing_matrix("complete", 4)
    assert torch.allclose(W, torch.full((4, 4), 0.25, dtype=torch.float64))


def test_unknown_topology_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of"):
        neighbours("torus", 4)
