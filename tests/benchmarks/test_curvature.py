"""The curvature measurement on least squares, where every Hessian is known exactly; the chain's
objectives are measured in tests/benchmarks/test_bench_fidelity.py, on that file's benchmark run."""
import pytest
import torch

from benchmarks import curvature
from admm_dist.engine.lsq import LeastSquares


def _problem(shared: bool):
    p = LeastSquares(n_nodes=3, dim=8, rows=12, shared_hessian=shared)
    data = [p.node_data(i) for i in range(3)]
    return p, [a.T @ a for a, _ in data], lambda i, x: data[i][0].T @ (data[i][0] @ x - data[i][1])


def test_hessian_vector_products_are_exact_on_a_quadratic():
    _, hessians, grad = _problem(False)
    z, v = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    v /= v.norm()
    for i, h in enumerate(hessians):
        assert torch.allclose(curvature.hvp(grad, i, z, v, curvature.EPS), h @ v, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("shared", [False, True])
def test_kappa_and_delta_h_along_the_directions_the_nodes_pull_apart(shared):
    p, hessians, grad = _problem(shared)
    z, rho = torch.zeros(8, dtype=torch.float64), 0.5
    r = curvature.probe(grad, range(3), z, rho=rho, probes=1)
    g = [grad(i, z) for i in range(3)]
    gbar = sum(g) / 3
    apart = [row for row in r["probes"] if row["direction"].startswith("apart")]
    assert [row["direction"] for row in r["probes"]] == ["random", "apart-0", "apart-1", "apart-2"]
    for i, row in enumerate(apart):
        v = (g[i] - gbar) / (g[i] - gbar).norm()
        hv = [h @ v for h in hessians]
        hbar = sum(hv) / 3
        assert row["kappa"] == pytest.approx(float(hbar.norm()) / rho, rel=1e-9)
        spread = float(torch.stack([(x - hbar).norm() for x in hv]).pow(2).mean().sqrt() / hbar.norm())
        assert row["delta_H"] == pytest.approx(spread, rel=1e-6, abs=1e-9)
        assert row["eps_check"] < 1e-8      # a quadratic: every step size gives the same product
    assert (r["apart"]["delta_H"] < 1e-9) == shared and (r["random"]["delta_H"] < 1e-9) == shared
    rms = float(torch.stack([x.norm() for x in g]).pow(2).mean().sqrt())
    assert r["pooled"] == pytest.approx(float(gbar.norm()) / rms)
    at_optimum = curvature.probe(grad, range(3), p.optimum(), rho=rho, probes=0)
    assert at_optimum["pooled"] < 1e-9 and at_optimum["random"]["kappa"] is None


def test_the_yardstick_shows_the_dual_matters_near_the_fixed_point_not_before():
    """Least squares with the chain's kind of x-step: after 4 rounds NoDual is where ADMM is;
    as the nodes' mean gradient vanishes (pooled -> 0), NoDual stays biased and ADMM does not.
    (The benchmark's 400 rounds, and one Hessian for every node, are in the command's table;
    tests/engine/test_admm.py checks that NoDual is exact with one Hessian.)"""
    rows = curvature.lsq_rows(probes=1, rounds=(4, 120), one_hessian=False)
    early, late = rows["lsq, 4 rounds"], rows["lsq, 120 rounds"]
    assert early["pooled"] > 0.3 > 0.02 > late["pooled"]
    assert abs(early["error"]["no_dual"] - early["error"]["ring"]) < 0.01 * early["error"]["ring"]
    assert late["error"]["ring"] < 0.05 * late["error"]["no_dual"] and late["error"]["no_dual"] > 0.3
    assert late["apart"]["delta_H"] > 0.3      # the nodes' own designs: different curvatures


@pytest.mark.parametrize("argv, msg", [
    (["--workdir", "/nonexistent/never", "--seeds", "1"], "python -m benchmarks.fidelity --workdir"),
    (["--workdir", "/nonexistent/never", "--seeds", "1,1"], "each once"),
])
def test_bad_input_is_one_line(argv, msg, capsys):
    assert curvature.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]
