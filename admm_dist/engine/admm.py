"""The consensus-ADMM state machine on flat vectors (docs/design.md section 2).

Each node i holds x_i, z_i and the scaled dual u_i, all flat vectors of one
layout. A round is:

1. x-step (supplied by the caller): approximately minimise
   f_i(x) + (rho/2) ||x - (z_i - u_i)||^2 starting from x_i;
2. z-step: v_i = x_i + u_i, then the communicator's consensus (exact mean, or
   gossip mixing which leaves each node its own z_i);
3. u-step: u_i += x_i - z_i;
4. telemetry: f_i, primal residual ||x_i - z_i|| and its normalised form,
   dual residual rho ||z_i^k - z_i^{k-1}||, ||x_1||, bytes, seconds per phase.

``consensus decentralized`` is node-based decentralized ADMM (Shi, Ling, Yuan, Wu, Yin, IEEE TSP
62(7), 2014): x_i <- argmin f_i(x) + <alpha_i, x> + c sum_{j in N_i} ||x - (x_i + x_j)/2||^2,
alpha_i += c sum_{j in N_i} (x_i - x_j). Completing the square, that is the same round with
rho_i = 2 c d_i, z_i = (x_i + mean_{j in N_i} x_j) / 2 (the communicator's one neighbour
exchange, fed x_i rather than x_i + u_i) and the scaled dual u_i = alpha_i / rho_i, which then
moves by exactly x_i - z_i. One exchange of x per round serves the next x-step's centre and the
dual, and the fixed point is the exact consensus optimum on any connected graph (sum_i alpha_i
stays 0). c = rho / (2 * mean degree): see
:func:`penalty_scale`.

Ablations: ``local_only`` (no coupling: rho = 0, no z/u exchange, z_i := x_i),
``no_dual`` (u_i stays 0). Pooled training is simply N = 1.

Adaptive rho (``rho_adapt``, residual balancing, Boyd et al. 2011, section 3.4.1): after
round k, with the global primal residual r = sqrt(sum_i ||x_i - z_i||^2) and dual residual
s = sqrt(sum_i (rho ||z_i^k - z_i^{k-1}||)^2), rho is multiplied by ``rho_tau`` when
r > ``rho_mu`` * s and divided by it when s > ``rho_mu`` * r. The duals are scaled
(u = y / rho), so every change of rho rescales them, u <- u * rho_old / rho_new, which keeps
y and hence the iterates' meaning. Every rank decides from the same gathered telemetry, so
all ranks change rho together; without telemetry, or with a single node (pooled: there is no
consensus to balance), rho stays fixed.

The engine talks only to a :class:`~admm_dist.engine.comm.Communicator`; it never
touches ranks or process groups.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from admm_dist.core.config_file import check_bounds, key
from admm_dist.core.errors import RunError, UserError
from admm_dist.engine.comm import CONSENSUS, DECENTRALIZED, IN_PROCESS, Communicator
from admm_dist.engine.seat_group import SeatGroup

COMM = "comm."   # the name prefix of the communicator's per-node state in a state_dict

# x-step: (node, x (updated in place), proximal centre z_i - u_i or None, rho) -> f_i
XStep = Callable[[int, torch.Tensor, Optional[torch.Tensor], float], float]

ROW_FIELDS = ("f", "primal", "z_norm", "dual", "x_norm", "bytes_sent", "bytes_recv",
              "bytes_in_process", "sec_x", "sec_z", "sec_other")


def penalty_scale(comm: Communicator, node: int) -> float:
    """rho_i / rho for ``node``'s x-step: 1, but d_i / mean degree under ``decentralized``.

    Node-based decentralized ADMM (Shi et al. 2014) has one constant c and gives node i the
    proximal weight 2 c d_i; c = rho / (2 * mean degree) makes the mean weight rho, so a
    setting of rho couples as strongly as in the other modes (exactly rho on every node of
    a regular graph: ring, complete, expander for a power of two)."""
    if comm.mode != DECENTRALIZED or comm.n_nodes == 1:
        return 1.0
    mean_degree = sum(len(n) for n in comm.neighbours) / comm.n_nodes
    return len(comm.neighbours[node]) / mean_degree


@dataclasses.dataclass(frozen=True, kw_only=True)
class ADMMConfig:
    rho: float = key(0.03, "ADMM penalty: how strongly each node is pulled to the consensus (lambda = 1/rho)",
                     at_least=0)
    local_only: bool = key(False,
                           "ADMM-Local ablation: no coupling (no z or u exchange); each node keeps its x_i")
    no_dual: bool = key(False, "ADMM-NoDual ablation: the duals u_i stay 0 (a penalty method)")
    rho_adapt: bool = key(False, "residual balancing (Boyd et al. 2011, 3.4.1): rho grows or shrinks "
                          "when one residual exceeds the other; duals are rescaled")
    rho_mu: float = key(10.0, "rho_adapt: change rho when one residual is rho_mu times the other", above=1)
    rho_tau: float = key(2.0, "rho_adapt: the factor rho is multiplied or divided by", above=1)

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.rho_adapt and (self.local_only or self.no_dual):
            raise UserError("rho_adapt balances primal and dual residuals of full ADMM: drop it for "
                            "local_only / no_dual")
        if self.rho == 0 and not self.local_only:
            raise UserError("rho=0 decouples the nodes: use local_only for that ablation, or rho > 0")
        if self.local_only and self.no_dual:
            raise UserError("local_only and no_dual are separate ablations: choose one")


class NonFiniteError(RunError, FloatingPointError):
    """A node's objective or state became NaN/inf; every rank raises it together."""


@dataclasses.dataclass
class RoundRecord:
    """Per-round telemetry for every node (lists are indexed by node)."""

    round: int
    f: List[float]
    primal: List[float]
    primal_normalized: List[float]
    dual: List[float]
    x1_norm: float
    bytes_sent: List[int]
    bytes_recv: List[int]
    sec_x: List[float]
    sec_z: List[float]
    sec_other: List[float]
    rho: float = 0.0               # the penalty this round's x-step used
    # bytes a node handed to another node of its own rank in memory (several nodes per rank);
    # bytes_sent / bytes_recv are the wire's
    bytes_in_process: List[int] = dataclasses.field(default_factory=list)

    def as_dict(self) -> Dict[str, object]:
        return dataclasses.asdict(self)


class ADMMEngine:
    """Holds (x_i, z_i, u_i) for the nodes this process owns and runs rounds."""

    def __init__(self, comm: Communicator, config: ADMMConfig,
                 x0: Sequence[torch.Tensor], seat: Optional[SeatGroup] = None) -> None:
        if len(x0) != len(comm.nodes):
            raise ValueError(f"x0 has {len(x0)} vectors but this process owns {len(comm.nodes)} node(s)")
        self.comm = comm
        self.seat = seat if seat is not None else SeatGroup()   # W = k x N: the ranks of this seat
        self.config = config
        self.nodes = comm.nodes
        self.x = [v.detach().clone().contiguous() for v in x0]
        for v in self.x:
            if v.dim() != 1 or v.dtype != torch.float32:
                raise ValueError(f"ADMM vectors are flat fp32; got shape {tuple(v.shape)} dtype {v.dtype}")
        self.z = [v.clone() for v in self.x]
        self.u = [torch.zeros_like(v) for v in self.x]
        self.round = 0
        self._rho = float(config.rho)
        self._scale = [penalty_scale(comm, node) for node in self.nodes]   # rho_i / rho
        self._decentralized = comm.mode == DECENTRALIZED and comm.n_nodes > 1
        self.history: List[RoundRecord] = []
        self._prev = [torch.empty_like(v) for v in self.x]

    @property
    def rho(self) -> float:
        """The penalty of the next x-step (changes between rounds under ``rho_adapt``)."""
        return 0.0 if self.config.local_only else self._rho

    def _adapt_rho(self, rec: "RoundRecord") -> None:
        r = math.sqrt(sum(p * p for p in rec.primal))
        s = math.sqrt(sum(d * d for d in rec.dual))
        cfg = self.config
        new = self._rho * cfg.rho_tau if r > cfg.rho_mu * s else \
            self._rho / cfg.rho_tau if s > cfg.rho_mu * r else self._rho
        if new != self._rho:
            for u in self.u:
                u.mul_(self._rho / new)      # scaled duals: y = rho u is what must not change
            self._rho = new

    @property
    def numel(self) -> int:
        return self.x[0].numel()

    def centre(self, k: int) -> Optional[torch.Tensor]:
        """The proximal centre z_i - u_i of local node index k (None under local_only)."""
        if self.config.local_only:
            return None
        return self.z[k] - self.u[k]

    def step(self, xstep: XStep, *, telemetry: bool = True) -> Optional[RoundRecord]:
        """Run one round; returns the gathered record (every node) when ``telemetry``."""
        self.round += 1
        meter = self.comm.meter
        meter.start_round(self.round)
        cfg = self.config

        t0 = time.perf_counter()
        f_local = []
        for k, node in enumerate(self.nodes):
            f_local.append(float(xstep(node, self.x[k], self.centre(k), self.rho * self._scale[k])))
        t1 = time.perf_counter()

        for k in range(len(self.nodes)):
            self._prev[k].copy_(self.z[k])
        if cfg.local_only:
            for k in range(len(self.nodes)):
                self.z[k].copy_(self.x[k])
        else:
            for k in range(len(self.nodes)):
                if self._decentralized:   # z_i = (x_i + mean_{j in N_i} x_j) / 2
                    self.z[k].copy_(self.x[k])
                else:
                    torch.add(self.x[k], self.u[k], out=self.z[k])
            if self.seat.leads:   # the seat's leader takes part in the consensus; its z goes to the group
                self.comm.consensus_(self.z)
            self.seat.broadcast(self.z, meter, self.nodes[0])
        t2 = time.perf_counter()

        if not (cfg.local_only or cfg.no_dual):
            for k in range(len(self.nodes)):
                self.u[k].add_(self.x[k]).sub_(self.z[k])
        rows = []
        for k, node in enumerate(self.nodes):
            c = meter.total(node=node, round=self.round, phase=CONSENSUS)
            copied = meter.total(node=node, round=self.round, phase=IN_PROCESS).sent
            rows.append([
                f_local[k],
                torch.linalg.vector_norm(self.x[k] - self.z[k]).item(),
                torch.linalg.vector_norm(self.z[k]).item(),
                self.rho * self._scale[k] * torch.linalg.vector_norm(self.z[k] - self._prev[k]).item(),
                torch.linalg.vector_norm(self.x[k]).item(),
                c.sent, c.recv, copied, t1 - t0, t2 - t1, 0.0,
            ])
        t3 = time.perf_counter()
        for r in rows:
            r[-1] = t3 - t2
        if not telemetry:
            return None
        table = self._every(torch.tensor(rows, dtype=torch.float64))
        rec = self._record(table)
        self.history.append(rec)
        bad = [i for i in range(table.shape[0])
               if not all(math.isfinite(v) for v in table[i, :5].tolist())]
        if bad:
            raise NonFiniteError(f"round {self.round}: non-finite objective or state on node(s) {bad}: "
                                 "rerun with resume=auto and a lower eta= or grad_clip= (both may change "
                                 "on resume: the run continues from its last checkpoint with them), or "
                                 "check that node's examples")
        if self.config.rho_adapt and self.comm.n_nodes > 1:
            self._adapt_rho(rec)
        return rec

    def _record(self, t: torch.Tensor) -> RoundRecord:
        col = {name: t[:, i].tolist() for i, name in enumerate(ROW_FIELDS)}
        norm = [p / zn if zn > 0 else (0.0 if p == 0 else math.inf)
                for p, zn in zip(col["primal"], col["z_norm"])]
        return RoundRecord(
            round=self.round, f=col["f"], primal=col["primal"], primal_normalized=norm,
            dual=col["dual"], x1_norm=col["x_norm"][0],
            bytes_sent=[int(b) for b in col["bytes_sent"]],
            bytes_recv=[int(b) for b in col["bytes_recv"]],
            bytes_in_process=[int(b) for b in col["bytes_in_process"]],
            sec_x=col["sec_x"], sec_z=col["sec_z"], sec_other=col["sec_other"], rho=self.rho)

    def run(self, xstep: XStep, rounds: int, *, telemetry: bool = True,
            on_round: Optional[Callable[[RoundRecord], None]] = None) -> List[RoundRecord]:
        for _ in range(rounds):
            rec = self.step(xstep, telemetry=telemetry)
            if on_round is not None and rec is not None:
                on_round(rec)
        return self.history

    def every_node(self, vectors: Sequence[torch.Tensor]) -> torch.Tensor:
        """[n_nodes, P]: one vector per local node (z_i, x_i) -> every node's, on every rank, in
        node order (metered as telemetry): what inexact consensus leaves each seat to deploy."""
        return self._every(torch.stack([v.detach().reshape(-1) for v in vectors]))

    def _every(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(nodes), k] -> [n_nodes, k]: gathered by the leaders, given to their seat groups."""
        table = (self.comm.gather_rows(rows) if self.seat.leads
                 else rows.new_empty(self.comm.n_nodes, rows.shape[1]))
        self.seat.broadcast([table])
        return table

    # -- state ------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This process's part of the run: the round, the penalty, the history and, per local node,
        its x, z, u and the communicator's state of it (``comm.<name>``: the public copies of
        compressed consensus)."""
        nodes = {}
        for k, node in enumerate(self.nodes):
            nodes[node] = {"x": self.x[k], "z": self.z[k], "u": self.u[k],
                           **{COMM + name: t for name, t in self.comm.node_state(node).items()}}
        return {"round": self.round, "rho": self._rho, "history": [r.as_dict() for r in self.history],
                "nodes": nodes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (of this placement, or of any other: per node)."""
        for k, node in enumerate(self.nodes):
            if node not in state["nodes"]:
                raise KeyError(f"the state holds no node {node}: it was saved for other nodes")
            own = state["nodes"][node]
            for name, dst in (("x", self.x), ("z", self.z), ("u", self.u)):
                src = own[name]
                if src.shape != dst[k].shape:
                    raise ValueError(f"{name} of node {node}: shape {tuple(src.shape)} != "
                                     f"{tuple(dst[k].shape)} (a state from another configuration)")
                dst[k].copy_(src)
            public = {name[len(COMM):]: t for name, t in own.items() if name.startswith(COMM)}
            if self.comm.compress != "none" and not public:
                raise ValueError(f"node {node}'s state lacks the public copies of "
                                 f"compress={self.comm.compress}")
            self.comm.load_node_state(node, public)
        self.round = int(state["round"])
        self._rho = float(state["rho"])
        self.history = [RoundRecord(**r) for r in state["history"]]
