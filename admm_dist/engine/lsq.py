"""Distributed least squares by consensus ADMM: the engine end to end on a convex problem.

Node i holds f_i(x) = 1/2 ||A_i x - b_i||^2 (its rows only). The centralised
optimum x* = (sum A_i^T A_i)^{-1} sum A_i^T b_i is known in closed form, so
this job shows, per round, how far the consensus is from it, together with
the residuals and the bytes each node sent.

    torchrun --standalone --nproc_per_node 3 -m admm_dist.cli.lsq --consensus ring
    python -m admm_dist.cli.lsq --nodes 3 --consensus gossip --topology chain   # one process

x-steps: ``exact`` solves the proximal problem in closed form; ``adam`` takes
``local_steps`` Adam steps on F_i, as the LLM trainer does.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from admm_dist.core.constants import LSQ_SALT
from admm_dist.core.errors import UserError
from admm_dist.engine.admm import ADMMConfig, ADMMEngine
from admm_dist.engine.comm import make_communicator


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeastSquares:
    """A_i, b_i for every node, generated from a seed (each rank can rebuild any node's share)."""

    n_nodes: int
    dim: int = 32
    rows: int = 48
    seed: int = 0
    hetero: float = 1.0  # how different the nodes' local optima are
    # every node gets node 0's A (one Hessian A^T A for all), each its own b: the case where the
    # penalty method (no_dual) is exact, so only different curvatures give the dual work to do
    shared_hessian: bool = False

    def __post_init__(self) -> None:
        if self.n_nodes < 1 or self.dim < 1:
            raise UserError("n_nodes and dim must be >= 1")
        if self.rows < self.dim:
            raise UserError(f"rows={self.rows} < dim={self.dim}: each node needs rows >= dim "
                            "for a unique local optimum")

    def node_data(self, i: int):
        a, g = self._design(i)
        x_true = torch.randn(self.dim, generator=g, dtype=torch.float64)
        shift = self.hetero * torch.randn(self.dim, generator=g, dtype=torch.float64)
        if self.shared_hessian:
            a = self._design(0)[0]
        b = a @ (x_true + shift) + 0.01 * torch.randn(self.rows, generator=g, dtype=torch.float64)
        return a, b

    def _design(self, i: int):
        """Node i's A, and its generator, which then draws the rest of node i's share."""
        g = torch.Generator().manual_seed(self.seed * LSQ_SALT + i)
        return torch.randn(self.rows, self.dim, generator=g, dtype=torch.float64) / math.sqrt(self.rows), g

    def objective(self, i: int, x: torch.Tensor) -> float:
        a, b = self.node_data(i)
        r = a @ x.double() - b
        return 0.5 * float(r @ r)

    def local_optimum(self, i: int) -> torch.Tensor:
        a, b = self.node_data(i)
        return torch.linalg.solve(a.T @ a, a.T @ b)

    def optimum(self) -> torch.Tensor:
        h = torch.zeros(self.dim, self.dim, dtype=torch.float64)
        g = torch.zeros(self.dim, dtype=torch.float64)
        for i in range(self.n_nodes):
            a, b = self.node_data(i)
            h += a.T @ a
            g += a.T @ b
        return torch.linalg.solve(h, g)

    def exact_xstep(self):
        """argmin_x f_i(x) + rho/2 ||x - centre||^2, solved in float64."""
        cache = {}

        def xstep(node: int, x: torch.Tensor, centre: Optional[torch.Tensor], rho: float) -> float:
            if node not in cache:
                a, b = self.node_data(node)
                cache[node] = (a.T @ a, a.T @ b)
            h, g = cache[node]
            eye = torch.eye(self.dim, dtype=torch.float64)
            rhs = g if centre is None else g + rho * centre.double()
            x.copy_(torch.linalg.solve(h + rho * eye, rhs))
            return self.objective(node, x)

        return xstep

    def adam_xstep(self, *, local_steps: int, eta: float):
        """``local_steps`` Adam steps on F_i; Adam moments persist across rounds."""
        opts = {}

        def xstep(node: int, x: torch.Tensor, centre: Optional[torch.Tensor], rho: float) -> float:
            a, b = (t.float() for t in self.node_data(node))
            if node not in opts:
                p = torch.nn.Parameter(x.clone())
                opts[node] = (p, torch.optim.Adam([p], lr=eta))
            p, opt = opts[node]
            with torch.no_grad():
                p.copy_(x)
            for _ in range(local_steps):
                opt.zero_grad(set_to_none=True)
                r = a @ p - b
                loss = 0.5 * (r @ r)
                if centre is not None and rho > 0:
                    loss = loss + 0.5 * rho * (p - centre).pow(2).sum()
                loss.backward()
                opt.step()
            with torch.no_grad():
                x.copy_(p)
            return self.objective(node, x)

        return xstep


def solve(problem: LeastSquares, *, consensus: str = "ring", topology: str = "ring",
          gossip_steps: int = 1, rho: float = 1.0, rounds: int = 100, local_only: bool = False,
          no_dual: bool = False, xstep: str = "exact", local_steps: int = 16, eta: float = 0.05,
          backend: str = "auto", timeout=None, on_round=None, rho_adapt: bool = False,
          compress: str = "none"):
    """Run consensus ADMM on ``problem``; returns (engine, history)."""
    comm = make_communicator(consensus, n_nodes=problem.n_nodes, topology=topology,
                             gossip_steps=gossip_steps, backend=backend, timeout=timeout, compress=compress)
    cfg = ADMMConfig(rho=rho, local_only=local_only, no_dual=no_dual, rho_adapt=rho_adapt)
    engine = ADMMEngine(comm, cfg, [torch.zeros(problem.dim) for _ in comm.nodes])
    step = (problem.exact_xstep() if xstep == "exact"
            else problem.adam_xstep(local_steps=local_steps, eta=eta))
    history = engine.run(step, rounds, on_round=on_round)
    return engine, history
