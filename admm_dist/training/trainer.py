"""The per-rank trainer: real transformers models, B-only LoRA, consensus ADMM rounds.

Every process owns the nodes its communicator gives it: one under torchrun (rank = node),
all of them with the single-process backend (one backbone, N adapter states switched by
copying the flat B vector). For each node it keeps the tokenized shard of the fit set, the
reference log-probs (computed once), an Adam optimizer over the flat B vector and a minibatch
sampler. A round is the engine's: ``local_steps`` Adam steps on
f_i + rho/2 ||x - (z_i - u_i)||^2 (the x-step, :meth:`Trainer.xstep`), then the z- and
u-steps through the communicator.

Wiring only: which communicator a launch gets (:func:`build_communicator`: a block of nodes per
rank under torchrun, every node in one process without it; docs/design.md section 5), the data
pipeline :mod:`~admm_dist.training.pipeline`, the collections and what the seats deploy for them
:mod:`~admm_dist.training.collecting`, the outputs
:mod:`~admm_dist.training.outputs`, checkpoints :mod:`~admm_dist.training.resume`, the
report :mod:`~admm_dist.training.report`, the trackers :mod:`~admm_dist.training.tracking`
and the progress bars :mod:`admm_dist.core.progress` (rank 0, not ``quiet``, on a terminal).
"""
from __future__ import annotations

import os
import random
import resource
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from admm_dist.core import progress
from admm_dist.core.constants import SAMPLER_SALT
from admm_dist.core.errors import UserError
from admm_dist.data import fitset as fs
from admm_dist.data.sampler import RoleBalancedSampler
from admm_dist.engine.admm import ADMMEngine, RoundRecord
from admm_dist.engine.comm import CONSENSUS, IN_PROCESS, TELEMETRY, Communicator, make_communicator
from admm_dist.engine.control import Control, control_for
from admm_dist.engine.dist import DistContext, RankMesh, build_mesh
from admm_dist.engine.placement import Placement
from admm_dist.engine.preemption import Preempted, PreemptionFlag, agree
from admm_dist.engine.seat_group import SEAT, SeatGroup, check_micro_batches
from admm_dist.model import batches as bt
from admm_dist.model import objectives as obj
from admm_dist.model.adapter import BOnlyLoRA
from admm_dist.model.loading import load_model
from admm_dist.model.objectives import ObjectiveConfig
from admm_dist.model.sharding import held_bytes

MEMORY_FIGURES = ("backbone_bytes", "adapter_bytes", "peak_rss_start")   # the report's, per rank
BYTE_PHASES = (CONSENSUS, IN_PROCESS, SEAT, TELEMETRY)                   # bytes_per_rank's
from admm_dist.model.vectors import check_same_basis, hash_to_int64_row, int64_row_to_hash, load_vector
from admm_dist.training import checkpoint as ckpt
from admm_dist.training import pipeline, resume
from admm_dist.training.collecting import (CollectionRunner, node_vectors, record_collection, sampled_under,
                                           seat_states)
from admm_dist.training.config import RESUMABLE, TrainConfig
from admm_dist.training.local_steps import (LocalSteps, checkpoint_activations, reference_logps,
                                            sampling_digest)
from admm_dist.training.outputs import RefusedError, RunOutputs, delta_w_rel, refusal
from admm_dist.training.report import TrainReport
from admm_dist.training.state import BestRound, NodeState, RunRecord
from admm_dist.training.tracking import Tracker, final_scalars, round_scalars


def build_communicator(cfg: TrainConfig, ctx: DistContext, placement: Placement,
                       collecting: bool) -> Tuple[Communicator, RankMesh]:
    """The communicator of this launch and where this rank sits: a block of nodes per rank under
    torchrun (W <= N), or k ranks per node (W = k x N, the leaders carrying the consensus); all
    nodes in one process otherwise (``placement`` has refused any other W). ``collecting``: the
    run collects on-policy (a sharded backbone cannot serve the seat's ranks' rollouts)."""
    n, k = cfg.n_nodes(), placement.k
    if ctx.env.is_distributed:
        if cfg.backend == "local":
            raise UserError("--backend local runs every node in one process: launch it "
                            "without torchrun (python -m admm_dist.train ...)")
        if k > 1:
            check_micro_batches(cfg.micro_batches, k)
            if cfg.shard_backbone and (collecting or cfg.recollect_every):
                raise UserError("shard_backbone=true with on-policy collection: the ranks of a seat "
                                "generate different rollouts, which a sharded backbone cannot serve; collect "
                                "without it (drop shard_backbone=) or train from a fit set (fitset_cache=)")
        backend = "process_group"
    else:
        if cfg.backend == "process_group":
            raise UserError("--backend process_group needs torchrun: torchrun "
                            f"--nproc_per_node {n} -m admm_dist.train ...")
        backend = "local"
    mesh = build_mesh(placement, ctx)
    return make_communicator(cfg.consensus, n_nodes=n, topology=cfg.topology, gossip_steps=cfg.gossip_steps,
                             timeout=ctx.timeout, backend=backend, compress=cfg.compress,
                             group=mesh.across), mesh


class Trainer:
    """One rank's part of a run: :meth:`train` sets up, runs ``k_outer`` rounds, writes outputs."""

    # made by setup() (the communicator decides this rank's nodes before anything loads)
    comm: Communicator
    control: Control                        # agreement between ranks, off the consensus path
    nodes: List[int]
    shards: Dict[int, List[fs.Example]]     # this rank's nodes' training examples
    dev_set: List[fs.Example]               # the held-out examples (every node's share)
    tokenizer: Any
    adapter: BOnlyLoRA
    model: Any                              # the adapter's wrapped backbone
    ocfg: ObjectiveConfig
    init_vec: Optional[torch.Tensor]        # init_state, the warm start
    fingerprint: str                        # what a checkpoint must match to be this run's
    identity: Dict[str, Any]                # what the fingerprint hashes (checkpoints record it)
    # made by build_nodes()
    state: Dict[int, NodeState]
    engine: ADMMEngine
    local_steps: LocalSteps                 # the nodes' x-steps (made by setup(), with the model)

    def __init__(self, cfg: TrainConfig, ctx: DistContext, log: Callable[[str], None] = progress.say,
                 preempt: Optional[PreemptionFlag] = None):
        self.cfg = cfg
        self.preempt = preempt   # None: train() notes SIGUSR2 itself while it runs
        self.ctx = ctx
        self.rank = ctx.rank
        self.show = not cfg.quiet and ctx.rank == 0    # progress bars and log lines
        self.talk = log if self.show else (lambda m: None)
        self.tracker = Tracker()   # report_to's writers, opened once the rounds are about to start
        self.report = TrainReport(config=cfg.as_dict(), out_path=os.path.realpath(cfg.out))   # output only
        self.record = RunRecord()   # the collections, the keys trained on, the dev curve: resumable
        self.outputs = RunOutputs(cfg, ctx.rank, self.talk)
        self.collections: Optional[CollectionRunner] = None   # made by setup(), with the communicator
        self.seat = SeatGroup()   # the ranks sharing this rank's seat (k = 1: this one)
        self.fit_digest: Optional[str] = None   # content of the first fit set (fingerprint)
        self.dev_encoded: Dict[int, list] = {}  # each node's held-out share, tokenized once
        self.best: Optional[BestRound] = None
        # each local node's state at the last re-collection
        self.collected_under: Optional[List[torch.Tensor]] = None
        self.tracked_dw: Optional[Tuple[int, float]] = None   # (round, delta_w_rel of z_0) track() logged
        self.t_start = time.time()

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.placement = Placement(cfg.n_nodes(), self.ctx.world_size)   # refuses a W it cannot place
        self.comm, self.mesh = build_communicator(self.cfg, self.ctx, self.placement, self.needs_collection())
        self.seat = self.mesh.seat
        self.control = control_for(self.ctx, self.placement.rank_blocks())
        if self.ctx.env.is_distributed:
            self.talk(f"placement: {self.placement.describe()}")
        self.nodes = list(self.comm.nodes)
        self.collections = CollectionRunner(cfg, self.ctx, self.comm, self.talk)
        self.check_outputs()
        collecting = self.needs_collection()
        if not collecting:  # a bad fit set fails before any weights load
            self.shards, self.dev_set = self.shard(self.read_fitset())
        self.collections.check_backend(collecting)   # and so does a missing vLLM
        if cfg.shard_backbone and self.seat.k == 1:
            self.talk("shard_backbone: one rank per seat, so nothing is sharded (launch k x seats ranks)")
        model, self.tokenizer = self.load_backbone()
        self.adapter = BOnlyLoRA(model, cfg.adapter_config())
        self.model = self.adapter.model
        checkpoint_activations(self.model, cfg, self.ctx.device.type)
        self.check_basis()
        self.ocfg = cfg.objective_config()
        self.local_steps = LocalSteps(cfg, self.model, self.adapter, self.ocfg, self.tokenizer.pad_token_id,
                                      self.seat)
        self.init_vec = None
        # after a re-collection: node -> the state its seat sampled under (before: init_vec)
        self.sampled_under: Dict[int, torch.Tensor] = {}
        if cfg.init_state:
            self.init_vec, _ = load_vector(cfg.init_state, self.adapter)
        if collecting:
            states = {} if self.init_vec is None else {s: self.init_vec for s in cfg.adapted_seats()}
            self.shards, self.dev_set = self.shard(self.collect(0, states))
        # What a checkpoint must match to be this run's: the settings that change what is
        # computed, the fit set's content (not its path) and the initial state's bytes.
        content = {"fitset": self.fit_digest, "init_state": pipeline.file_fingerprint(cfg.init_state)}
        self.identity = {"settings": cfg.semantic(self.ctx.device), **content}   # recorded in checkpoints
        self.fingerprint = fs.settings_key({"settings": cfg.fingerprint(self.ctx.device), **content})[:16]

    def check_outputs(self) -> None:
        self.outputs.check(self.control)

    def load_backbone(self):
        """The backbone and tokenizer in the run's ``dtype``, through the one loader; with
        ``shard_backbone`` each rank of a seat reads only its shard (:mod:`admm_dist.model.sharding`)."""
        shard = self.mesh.shard if self.cfg.shard_backbone else None   # FSDP2's mesh: the seat group
        model, tok = load_model(self.cfg.model_name, self.ctx.device, shard_over=shard, dtype=self.cfg.dtype)
        model.config.use_cache = False
        return model, tok

    def check_basis(self) -> None:
        """Every rank built the same LoRA A basis (one hash row per node, compared)."""
        rows = torch.cat([hash_to_int64_row(self.adapter.basis_hash())] * len(self.nodes))
        table = self.control.table(rows)
        check_same_basis([int64_row_to_hash(table[i:i + 1]) for i in range(table.shape[0])])

    # ------------------------------------------------------------------ data
    def needs_collection(self) -> bool:
        return pipeline.needs_collection(self.cfg)

    def read_fitset(self) -> fs.FitSet:
        f = pipeline.read_fitset(self.cfg, self.report, self.record)
        self.fit_digest = fs.content_key(f)
        return f

    def shard(self, f: fs.FitSet, hold_out: bool = True):
        return pipeline.shard(self.cfg, f, self.nodes, self.report, self.talk, hold_out=hold_out)

    def collect(self, collection: int, states: Dict[int, torch.Tensor]) -> fs.FitSet:
        """Roll out the MAS on this collection's training queries (every rank a share)."""
        f = self.collections.fitset(collection, states, model=self.model, tokenizer=self.tokenizer,
                                    adapter=self.adapter)
        record_collection(self.cfg, f, collection, record=self.record, report=self.report,
                          tracker=self.tracker, talk=self.talk, rank=self.rank)
        if collection == 0:
            self.fit_digest = fs.content_key(f)
        return f

    def recollect(self, collection: int, vectors: Optional[List[torch.Tensor]] = None) -> None:
        """Fresh queries, each seat under the state it deploys (:func:`node_vectors`): now, or as a
        resumed checkpoint kept it (``vectors``, one per local node); that state becomes its node's
        sampling policy (GRPO's ratio) and, under ``kl_ref collect``, its KL reference. The
        held-out set stays the first collection's: every example of this one is trained on."""
        if vectors is None:
            vectors = node_vectors(self.cfg, self.engine, len(self.nodes))
        self.collected_under = vectors        # kept in every checkpoint until the next collection
        states = seat_states(self.cfg, self.engine, vectors)
        self.shards, _ = self.shard(self.collect(collection, states), hold_out=False)
        self.sampled_under = sampled_under(self.cfg, states, self.nodes)
        self.encode_nodes()

    # ------------------------------------------------------------------ nodes
    def build_nodes(self) -> None:
        cfg = self.cfg
        self.state = {}
        for node in self.nodes:
            opt = torch.optim.Adam([self.adapter.param], lr=cfg.eta, foreach=False)
            self.state[node] = NodeState(node, [], None, opt)
        self.encode_nodes()
        x0 = self.init_vec if self.init_vec is not None else torch.zeros(self.adapter.numel)
        self.engine = ADMMEngine(self.comm, cfg.admm_config(),
                                 [x0.to(self.ctx.device, torch.float32) for _ in self.nodes], seat=self.seat)
        self.best = None

    def encode_nodes(self) -> None:
        """Tokenize each node's shard, compute its reference log-probs (and for grpo the sampling
        policy's, under the state its seat sampled with), (re)start its sampler."""
        cfg = self.cfg
        for node in self.nodes:
            if not self.shards[node]:    # f_i = 0 (empty_nodes prox): nothing to encode
                self.state[node].encoded, self.state[node].sampler, self.state[node].sampling = [], None, None
                continue
            enc = bt.encode(self.tokenizer, self.shards[node], self.ocfg)
            if not enc:
                raise UserError(f"node {node}: every example became empty after truncation: "
                                "raise --max_target_tokens")
            pipeline.check_context(cfg, self.model, enc)
            sampled = self.sampled_under.get(node, self.init_vec)   # None: the bare backbone's
            self.reference(enc, sampled if cfg.kl_ref == "collect" else None)
            if self.ocfg.needs_sampling:
                if cfg.kl_ref == "collect":   # the reference is the sampling policy: one forward serves both
                    for e in enc:
                        e.sample_logps = e.ref_logps
                else:
                    self.reference(enc, sampled, sampling=True)
                self.state[node].sampling = sampling_digest(enc)
            self.state[node].encoded = enc
            self.state[node].sampler = RoleBalancedSampler(enc, cfg.batch_size,
                                                           cfg.seed * SAMPLER_SALT + node,
                                                           balance=not cfg.no_role_balance)

    def reference(self, enc, vec: Optional[torch.Tensor], sampling: bool = False) -> None:
        """Reference log-probs (``sampling``: the sampling policy's), once per example: under the
        adapter state ``vec`` (the policy that collected them), or adapters off (None); a seat's k
        ranks compute a batch each in turn and share them."""
        reference_logps(self.cfg, self.adapter, self.seat, enc, vec, self.tokenizer.pad_token_id, self.show,
                        sampling=sampling)

    # ------------------------------------------------------------------ x-step
    def xstep(self, node: int, x: torch.Tensor, centre: Optional[torch.Tensor], rho: float) -> float:
        """``local_steps`` Adam steps on f_i(x) + rho/2 ||x - centre||^2, centre = z_i - u_i."""
        return self.local_steps.run(self.state[node], x, centre, rho)

    # ------------------------------------------------------------------ rounds
    def train(self) -> Dict[str, object]:
        """Set up, run the rounds, write the outputs; the report as a dict."""
        restore = lambda: None  # noqa: E731
        if self.preempt is None:   # train.main installs it before anything else
            self.preempt = PreemptionFlag()
            restore = self.preempt.install()
        try:
            return self._train()
        finally:
            restore()
            self.tracker.close()
            if self.collections is not None:
                self.collections.close()
            self.outputs.release()

    def _train(self) -> Dict[str, object]:
        cfg = self.cfg
        self.setup()
        self.build_nodes()
        self.report.n_nodes = self.comm.n_nodes
        self.report.numel = self.adapter.numel
        self.report.basis_hash = self.adapter.basis_hash()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux counts KiB
        held = self.control.per_rank([*held_bytes(self.model), rss])   # every rank's, once loaded
        self.report.memory = {key: [int(r[i]) for r in held] for i, key in enumerate(MEMORY_FIGURES)}
        if self.ctx.env.is_distributed:
            size = sum(p.numel() * p.element_size() for n, p in self.model.named_parameters()
                       if "lora_" not in n)
            self.talk(self.placement.backbone(size, [r[0] for r in held], cfg.shard_backbone))
        if cfg.dry_run:
            self.talk("dry run: fit sets built, stopping before any gradient step")
            self.outputs.write_report(self.reported(), "dryrun")
            return self.report.as_dict()
        # Everything is checked and loaded: only now may overwrite remove the old run's files.
        self.outputs.clear_old_run(self.control)
        if cfg.resume == "auto":
            self.try_resume()
        root = ckpt.ckpt_root(cfg.out)
        if self.agree_preempt():   # the warning came while loading, collecting or resuming
            raise Preempted(self.engine.round, in_setup=True)
        self.tracker = self.outputs.open_tracker(self.control, self.fingerprint, self.engine.round,
                                                 self.record)
        with progress.bar(total=cfg.k_outer, initial=self.engine.round, desc="rounds", unit="round",
                          show=self.show) as bar:
            while self.engine.round < cfg.k_outer:
                rec = self.engine.step(self.xstep)
                self.on_round(rec)
                if cfg.recollect_every and self.engine.round % cfg.recollect_every == 0 \
                        and self.engine.round < cfg.k_outer:
                    self.recollect(self.engine.round // cfg.recollect_every)
                stop = self.engine.round < cfg.k_outer and self.agree_preempt()
                if stop or self.engine.round % cfg.checkpoint_every == 0 or self.engine.round == cfg.k_outer:
                    self.checkpoint(root)
                self.track(rec)     # every byte of the round has crossed the wire
                bar.set_postfix_str(f"primal {max(rec.primal_normalized):.2e}", refresh=False)
                bar.update(1)
                if stop:
                    self.report.preempted_after_round = self.engine.round
                    self.outputs.write_report(self.reported(), "preempted")
                    raise Preempted(self.engine.round)
        return self.finish()   # a warning from here on is ignored: the run is finishing

    def agree_preempt(self) -> bool:
        return agree(self.preempt, self.control)

    def on_round(self, rec: RoundRecord) -> None:
        cfg = self.cfg
        k = rec.round
        if self.dev_set and (k % cfg.dev_every == 0 or k == cfg.k_outer) and not cfg.local_only:
            nll = self.dev_nll()
            self.record.add_dev_point(k, nll)
            if self.best is None or nll < self.best.dev_nll:
                self.best = BestRound(nll, k, self.engine.z[0].detach().clone())
        f = ", ".join("-" if i in self.report.empty_nodes else f"{v:.4g}" for i, v in enumerate(rec.f))
        self.talk(f"round {k:3d}/{cfg.k_outer}  f=[{f}]  "
                  f"primal={max(rec.primal_normalized):.3e}  dual={max(rec.dual):.3e}  "
                  + (f"rho={rec.rho:.3g}->{self.engine.rho:.3g}  " if cfg.rho_adapt else "") +
                  f"sent={max(rec.bytes_sent)} B  x-step {max(rec.sec_x):.2f}s "
                  f"z-step {max(rec.sec_z):.3f}s")

    def track(self, rec: RoundRecord) -> None:
        """The round's figures to the trackers (rank 0; every node's are in ``rec``)."""
        if not self.tracker.active:
            return
        tele = self.comm.meter.total(node=self.nodes[0], round=rec.round, phase=TELEMETRY)
        dev = [p["dev_nll"] for p in self.record.dev_curve if p["round"] == rec.round]
        dw = delta_w_rel(self.adapter, self.engine.z[0], self.cfg.lora_alpha, self.cfg.lora_rank)
        self.tracked_dw = (rec.round, dw)   # the last round's is the result's: finish() reuses it
        self.tracker.log(rec.round, round_scalars(rec, telemetry_sent=tele.sent, telemetry_recv=tele.recv,
                                                  dev_nll=dev[-1] if dev else None, delta_w_rel=dw))

    def dev_nll(self) -> float:
        """Mean target-token NLL of each node's z_i on its share of the held-out set."""
        rows = []
        for k, node in enumerate(self.nodes):
            share = self.dev_set[node::self.comm.n_nodes]
            self.adapter.load_vector(self.engine.z[k])
            if share and node not in self.dev_encoded:   # the held-out share is fixed
                self.dev_encoded[node] = bt.encode(self.tokenizer, share, self.ocfg)
            rows.append(list(obj.nll_sum(self.model, self.dev_encoded.get(node, []), self.cfg.forward_rows,
                                         self.tokenizer.pad_token_id)))
        table = self.control.table(torch.tensor(rows, dtype=torch.float64))
        return float(table[:, 0].sum() / table[:, 1].sum().clamp_min(1))

    # ------------------------------------------------------------------ checkpoints
    def checkpointed(self) -> resume.Checkpointed:
        """The objects a checkpoint is written from and restored into."""
        return resume.Checkpointed(self.engine, self.state, self.record, self.best, self.collected_under)

    def checkpoint(self, root: str) -> None:
        resume.save_round(root, self.checkpointed(), self.control, fingerprint=self.fingerprint,
                          identity=self.identity, resumable={k: getattr(self.cfg, k) for k in RESUMABLE},
                          keep=self.cfg.keep_checkpoints, writer=self.seat.leads)

    def try_resume(self) -> None:
        agreed = resume.agreed_round(self.cfg, self.control, self.nodes, self.fingerprint, self.identity,
                                     talk=self.talk)
        if agreed == 0:
            self.talk("resume auto: no complete checkpoint on every rank; starting from round 0")
            return
        run = self.checkpointed()
        resume.restore_round(self.cfg, agreed, run, fingerprint=self.fingerprint, device=self.ctx.device,
                             report=self.report, recollect=self.recollect)
        self.best = run.best
        changed = self.report.resumed["changed"]
        self.talk(f"resume auto: continuing after round {agreed}" + "".join(
            f"; {k} changed {then:g} -> {now:g}" for k, (then, now) in changed.items()))

    # ------------------------------------------------------------------ outputs
    def reported(self) -> TrainReport:
        """The report, with the run's record copied in (it is written, never read back)."""
        self.record.fill(self.report)
        return self.report

    def finish(self) -> Dict[str, object]:
        cfg, report = self.cfg, self.reported()
        hist = self.engine.history
        report.rounds = [r.as_dict() for r in hist]
        report.loss_curve = [r.f for r in hist]
        report.normalized_primal_residual_curve = [r.primal_normalized for r in hist]
        report.x1_norm_curve = [r.x1_norm for r in hist]
        report.comm_bytes_per_round_per_node = [r.bytes_sent for r in hist]
        report.backend = self.comm.__class__.__name__
        report.placement = [list(b) for b in self.placement.rank_blocks()]
        counts = [self.comm.meter.total(phase=phase) for phase in BYTE_PHASES]   # this rank's, the whole run
        # every rank's
        cols = list(zip(*self.control.per_rank([n for c in counts for n in (c.sent, c.recv)])))
        report.bytes_per_rank = {ph: {"sent": [int(v) for v in cols[2 * i]],
                                      "recv": [int(v) for v in cols[2 * i + 1]]}
                                 for i, ph in enumerate(BYTE_PHASES)}
        report.train_sec = round(time.time() - self.t_start, 2)
        deploy_local = cfg.local_only or not self.comm.exact
        result = [self.engine.x[j] if cfg.local_only else self.engine.z[j] for j in range(len(self.nodes))]
        # z_0's figure at this round was measured once already, for the trackers: reuse it
        known = (self.tracked_dw[1] if self.tracked_dw is not None and not cfg.local_only
                 and self.tracked_dw[0] == self.engine.round else None)
        dw = [known if j == 0 and known is not None
              else delta_w_rel(self.adapter, v, cfg.lora_alpha, cfg.lora_rank)
              for j, v in enumerate(result)]
        dws = self.control.table(torch.tensor([[d] for d in dw], dtype=torch.float64))
        dw_all = [float(v) for v in dws[:, 0]]
        report.delta_w_rel = dw_all if deploy_local else dw_all[0]
        self.tracker.log(self.engine.round, final_scalars(dw_all, deploy_local))
        report.deploy_required = "local" if deploy_local else None
        why = refusal(cfg, dw_all, report.get("node_sizes"))
        if why is not None:
            self.outputs.write_report(report, "refused")
            raise RefusedError(why)
        self.outputs.write_results(engine=self.engine, control=self.control, adapter=self.adapter,
                                   nodes=self.nodes if self.seat.leads else [],   # a seat's leader writes it
                                   report=report, best=self.best, deploy_local=deploy_local,
                                   fingerprint=self.fingerprint)
        return report.as_dict()
