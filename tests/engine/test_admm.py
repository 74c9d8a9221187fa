"""The ADMM state machine on a convex problem with a closed-form optimum (one process)."""
import math

import pytest
import torch

from admm_dist.engine.admm import ADMMConfig, ADMMEngine, NonFiniteError
from admm_dist.engine.comm import CONSENSUS, TOPOLOGIES, LocalCommunicator
from admm_dist.engine.lsq import LeastSquares, solve


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("mode", ["coordinator", "ring"])
def test_exact_consensus_reaches_the_centralized_optimum(mode):
    prob = LeastSquares(n_nodes=4, dim=16, rows=24, seed=1)
    engine, hist = solve(prob, consensus=mode, rho=1.0, rounds=120, backend="local")
    x_star = prob.optimum()
    for z in engine.z:
        assert rel(z, x_star) <= 1e-4
    # residuals shrink and every node reports them
    assert len(hist) == 120 and len(hist[-1].primal) == 4
    assert max(hist[-1].primal) < 1e-3 * max(hist[0].primal)
    assert max(hist[-1].dual) < 1e-3 * max(hist[0].dual)
    assert all(math.isfinite(v) for v in hist[-1].primal_normalized)


def test_adam_xsteps_also_reach_the_optimum():
    prob = LeastSquares(n_nodes=3, dim=8, rows=12, seed=2)
    engine, _ = solve(prob, consensus="ring", rho=1.0, rounds=150, xstep="adam",
                      local_steps=20, eta=0.02, backend="local")
    assert rel(engine.z[0], prob.optimum()) <= 1e-2


def _spread(zs):
    zs = torch.stack(zs).double()
    return float((zs - zs.mean(0)).norm(dim=1).max() / zs.mean(0).norm())


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_gossip_admm_approaches_consensus_closer_with_larger_tau(topology):
    """Inexact (gossip) consensus settles at a fixed point whose disagreement shrinks with tau."""
    prob = LeastSquares(n_nodes=6, dim=8, rows=12, seed=3)
    x_star = prob.optimum()
    local, _ = solve(prob, rho=1.0, rounds=2, local_only=True, backend="local")
    spread, err = {0: _spread(local.x)}, {}
    for tau in (1, 4):
        engine, hist = solve(prob, consensus="gossip", topology=topology, gossip_steps=tau,
                             rho=1.0, rounds=60, backend="local")
        spread[tau] = _spread(engine.z)
        err[tau] = max(rel(z, x_star) for z in engine.z)
        # settled: the last rounds no longer move z
        assert max(hist[-1].dual) < 1e-4 * max(hist[0].dual), (topology, tau)
    assert spread[1] < 0.7 * spread[0], (topology, spread)
    if topology == "complete":  # one mixing step is the exact mean
        assert spread[1] < 1e-5 and err[1] < 1e-4
    else:
        assert spread[4] < 0.8 * spread[1], (topology, spread)
        assert err[4] < err[1], (topology, err)


def test_local_only_reaches_each_local_optimum_and_communicates_nothing():
    prob = LeastSquares(n_nodes=3, dim=8, rows=12, seed=4)
    engine, hist = solve(prob, consensus="ring", rho=1.0, rounds=3, local_only=True,
                         backend="local")
    for k, node in enumerate(engine.nodes):
        assert rel(engine.x[k], prob.local_optimum(node)) <= 1e-5
        assert torch.equal(engine.z[k], engine.x[k])  # each node deploys its own x_i
        assert torch.count_nonzero(engine.u[k]) == 0
    meter = engine.comm.meter
    assert meter.total(phase=CONSENSUS).sent == 0 and meter.total(phase=CONSENSUS).recv == 0
    assert all(b == 0 for r in hist for b in r.bytes_sent + r.bytes_recv)
    # the local optima differ, so there was something to agree on
    assert rel(prob.local_optimum(0), prob.local_optimum(1)) > 0.1


def test_local_only_without_telemetry_sends_no_byte_at_all():
    prob = LeastSquares(n_nodes=3, dim=8, rows=12, seed=4)
    comm = LocalCommunicator(mode="ring", n_nodes=3)
    engine = ADMMEngine(comm, ADMMConfig(local_only=True), [torch.zeros(8)] * 3)
    engine.run(prob.exact_xstep(), 2, telemetry=False)
    assert comm.meter.total().sent == 0 and comm.meter.total().calls == 0


def test_no_dual_keeps_u_zero_and_converges_to_the_penalty_fixed_point():
    prob = LeastSquares(n_nodes=3, dim=6, rows=10, seed=5)
    rho = 0.5
    engine, _ = solve(prob, consensus="ring", rho=rho, rounds=400, no_dual=True, backend="local")
    assert all(torch.count_nonzero(u) == 0 for u in engine.u)
    # Fixed point: x_i = (H_i + rho I)^-1 (g_i + rho z), z = mean_i x_i (linear in z).
    d, n = prob.dim, prob.n_nodes
    eye = torch.eye(d, dtype=torch.float64)
    m = torch.zeros(d, d, dtype=torch.float64)
    c = torch.zeros(d, dtype=torch.float64)
    for i in range(n):
        a, b = prob.node_data(i)
        inv = torch.linalg.inv(a.T @ a + rho * eye)
        m += rho * inv / n
        c += inv @ (a.T @ b) / n
    z_fix = torch.linalg.solve(eye - m, c)
    assert rel(engine.z[0], z_fix) <= 1e-4
    # ... which is not the centralized optimum: the dual is what removes the bias
    assert rel(z_fix, prob.optimum()) > 1e-3


@pytest.mark.parametrize("rho", [0.1, 1.0])
def test_no_dual_is_exact_when_every_node_has_the_same_hessian(rho):
    # At the penalty fixed point H (x_i - a_i) + rho (x_i - z) = 0 with z = mean_i x_i; one H for
    # every node makes the mean of x_i - z vanish only at z = mean_i a_i, the optimum. So the dual
    # corrects the spread of the nodes' curvatures, not of their local optima.
    one = LeastSquares(n_nodes=4, dim=8, rows=12, seed=2, shared_hessian=True)
    assert all(torch.equal(one.node_data(i)[0], one.node_data(0)[0]) for i in range(4))
    assert rel(one.local_optimum(1), one.local_optimum(0)) > 0.5     # different local optima
    many = LeastSquares(n_nodes=4, dim=8, rows=12, seed=2)
    assert torch.equal(many.node_data(0)[0], one.node_data(0)[0])
    for prob, biased in ((one, False), (many, True)):
        x_star = prob.optimum()
        ring, _ = solve(prob, consensus="ring", rho=rho, rounds=300, backend="local")
        penalty, _ = solve(prob, consensus="ring", rho=rho, rounds=300, no_dual=True, backend="local")
        assert rel(ring.z[0], x_star) <= 1e-5
        assert (rel(penalty.z[0], x_star) > 1e-2) == biased, (rho, biased)
        if not biased:
            assert rel(penalty.z[0], x_star) <= 1e-5


def test_pooled_single_node_is_a_proximal_method_with_u_zero():
    prob = LeastSquares(n_nodes=1, dim=8, rows=12, seed=6)
    engine, hist = solve(prob, consensus="ring", rho=0.1, rounds=80, backend="local")
    assert torch.count_nonzero(engine.u[0]) == 0
    assert torch.equal(engine.z[0], engine.x[0])
    assert rel(engine.z[0], prob.optimum()) <= 1e-4
    assert engine.comm.meter.total(phase=CONSENSUS).sent == 0


def test_round_record_fields_and_state_roundtrip():
    prob = LeastSquares(n_nodes=3, dim=8, rows=12, seed=7)
    engine, hist = solve(prob, consensus="gossip", topology="chain", rho=1.0, rounds=4,
                         backend="local")
    rec = hist[-1].as_dict()
    for key in ("f", "primal", "primal_normalized", "dual", "bytes_sent", "bytes_recv",
                "sec_x", "sec_z", "sec_other"):
        assert len(rec[key]) == 3, key
    assert rec["round"] == 4 and rec["x1_norm"] == pytest.approx(float(engine.x[0].norm()))
    # chain of 3: the middle node has two neighbours
    assert rec["bytes_sent"] == [4 * 8, 2 * 4 * 8, 4 * 8]
    assert rec["f"][1] == pytest.approx(prob.objective(1, engine.x[1]))

    state = engine.state_dict()
    other = ADMMEngine(LocalCommunicator(mode="gossip", n_nodes=3, topology="chain"),
                       ADMMConfig(rho=1.0), [torch.zeros(8)] * 3)
    other.load_state_dict(state)
    assert other.round == 4
    assert [r.as_dict() for r in other.history] == [r.as_dict() for r in engine.history]   # the history too
    step = prob.exact_xstep()
    engine.step(step)
    other.step(step)
    for a, b in zip(engine.z + engine.u, other.z + other.u):
        assert torch.equal(a, b)
    bad = ADMMEngine(LocalCommunicator(mode="ring", n_nodes=3), ADMMConfig(), [torch.zeros(5)] * 3)
    with pytest.raises(ValueError, match="another configuration"):
        bad.load_state_dict(state)


def test_non_finite_objective_stops_with_the_round_and_node_named():
    comm = LocalCommunicator(mode="ring", n_nodes=3)
    engine = ADMMEngine(comm, ADMMConfig(rho=1.0), [torch.zeros(4)] * 3)

    def xstep(node, x, centre, rho):
        return float("nan") if node == 2 else 0.0

    with pytest.raises(NonFiniteError, match=r"round 1: .*node\(s\) \[2\]"):
        engine.step(xstep)


@pytest.mark.parametrize("kw,match", [
    (dict(rho=-1.0), ">= 0"),
    (dict(rho=float("nan")), "rho=nan: use a number >= 0"),
    (dict(rho=0.0), "local_only"),
    (dict(local_only=True, no_dual=True), "choose one"),
])
def test_bad_config_says_how_to_fix_it(kw, match):
    with pytest.raises(ValueError, match=match):
        ADMMConfig(**kw)


def test_bad_vectors_are_rejected():
    with pytest.raises(ValueError, match="flat fp32"):
        ADMMEngine(LocalCommunicator(mode="ring", n_nodes=1), ADMMConfig(), [torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="owns 2"):
        ADMMEngine(LocalCommunicator(mode="ring", n_nodes=2), ADMMConfig(), [torch.zeros(2)])


@pytest.mark.parametrize("rho0", [1e-3, 1e3])
def test_rho_adapt_balances_residuals_and_reaches_the_optimum_sooner(rho0):
    """Residual balancing from a badly chosen rho: rho moves towards the residuals' balance,
    the rescaled duals keep the same fixed point (the centralized optimum), and it gets
    there in fewer rounds than the fixed rho."""
    prob = LeastSquares(n_nodes=4, dim=16, rows=24, seed=1)
    x_star = prob.optimum()
    adapt, hist = solve(prob, consensus="ring", rho=rho0, rounds=300, backend="local", rho_adapt=True)
    assert rel(adapt.z[0], x_star) <= 1e-5
    rhos = [r.rho for r in hist]
    assert rhos[0] == rho0 and ((max(rhos) > rho0) if rho0 < 1 else (min(rhos) < rho0))
    # after 60 rounds the adapted run is far closer to the optimum than the fixed one
    a60, _ = solve(prob, consensus="ring", rho=rho0, rounds=60, backend="local", rho_adapt=True)
    f60, _ = solve(prob, consensus="ring", rho=rho0, rounds=60, backend="local")
    assert rel(a60.z[0], x_star) < 0.1 * rel(f60.z[0], x_star)
    # the state (with rho) round-trips: a resumed engine continues identically
    state = adapt.state_dict()
    assert state["rho"] == adapt.rho
    other = ADMMEngine(LocalCommunicator(mode="ring", n_nodes=4), ADMMConfig(rho=rho0, rho_adapt=True),
                       [torch.zeros(16)] * 4)
    other.load_state_dict(state)
    step = prob.exact_xstep()
    adapt.step(step)
    other.step(step)
    assert other.rho == adapt.rho and all(torch.equal(a, b) for a, b in zip(adapt.u, other.u))


def test_rho_adapt_rescales_the_scaled_duals():
    """u = y / rho: when rho doubles, u halves, so rho * u (the unscaled dual) is unchanged."""
    prob = LeastSquares(n_nodes=3, dim=8, rows=12, seed=2)
    step = prob.exact_xstep()
    engines = [ADMMEngine(LocalCommunicator(mode="ring", n_nodes=3), ADMMConfig(rho=1e-4, rho_adapt=a),
                          [torch.zeros(8)] * 3) for a in (False, True)]
    for e in engines:
        e.step(step)
    fixed, adapt = engines
    assert adapt.history[-1].rho == 1e-4 and adapt.rho == 2e-4   # the primal residual dominates
    assert all(torch.equal(a, b) for a, b in zip(fixed.z, adapt.z))
    for uf, ua in zip(fixed.u, adapt.u):
        assert torch.allclose(fixed.rho * uf, adapt.rho * ua, rtol=1e-6, atol=0)
    for kw in (dict(rho_mu=1.0), dict(rho_tau=0.5), dict(rho_adapt=True, no_dual=True)):
        with pytest.raises(ValueError):
            ADMMConfig(**kw)


def test_rho_adapt_leaves_a_single_node_alone():
    """Pooled (N = 1): u stays 0 and the primal residual is 0, so there is nothing to balance."""
    prob = LeastSquares(n_nodes=1, dim=8, rows=12, seed=3)
    engine, hist = solve(prob, consensus="ring", rho=0.5, rounds=5, backend="local", rho_adapt=True)
    assert [r.rho for r in hist] == [0.5] * 5 and engine.rho == 0.5


def test_decentralized_couples_as_strongly_as_rho_and_exchanges_once():
    """c = rho / (2 mean degree): node i's x-step penalty is rho d_i / mean degree (rho on a
    regular graph); its mixing row is 1/2 for itself and 1/(2 d_i) per neighbour; gossip_steps
    other than 1 is refused, naming the fix."""
    from admm_dist.core.errors import UserError
    from admm_dist.engine.admm import penalty_scale

    ring = LocalCommunicator(mode="decentralized", n_nodes=4, topology="ring")
    assert [penalty_scale(ring, i) for i in range(4)] == [1.0] * 4
    chain = LocalCommunicator(mode="decentralized", n_nodes=4, topology="chain")   # degrees 1, 2, 2, 1
    assert [penalty_scale(chain, i) for i in range(4)] == [1 / 1.5, 2 / 1.5, 2 / 1.5, 1 / 1.5]
    assert chain.weights[0] == {0: 0.5, 1: 0.5} and chain.weights[1] == {0: 0.25, 1: 0.5, 2: 0.25}
    assert not chain.exact and chain.analytic_bytes(10, 1) == 2 * 10 * 4
    assert penalty_scale(LocalCommunicator(mode="gossip", n_nodes=4, topology="chain"), 0) == 1.0
    with pytest.raises(UserError, match="gossip_steps is for consensus gossip"):
        LocalCommunicator(mode="decentralized", n_nodes=4, gossip_steps=2)


def test_decentralized_reaches_the_optimum_where_gossip_stays_biased():
    """Least squares, 4 nodes on a ring, exact x-steps: one neighbour exchange per round reaches
    the pooled optimum; gossip with the same exchange stops far from it (the seed's method)."""
    p = LeastSquares(n_nodes=4, seed=0)
    x_star = p.optimum()
    err = {}
    for mode in ("decentralized", "gossip"):
        engine, _ = solve(p, consensus=mode, topology="ring", rho=1.0, rounds=300)
        err[mode] = max(float((x.double() - x_star).norm() / x_star.norm()) for x in engine.x)
    assert err["decentralized"] <= 1e-5 and err["gossip"] >= 0.1, err
