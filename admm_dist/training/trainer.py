"""The per-rank trainer: real transformers models, B-only LoRA, consensus ADMM rounds.

Every process owns the nodes its communicator gives it: one under torchrun
(rank = node), all of them with the single-process backend (one backbone, N
adapter states switched by copying the flat B vector). For each node it keeps
the tokenized shard of the fit set, the reference log-probs (computed once),
an Adam optimizer over the flat B vector and a minibatch sampler. A round is
the engine's: ``local_steps`` Adam steps on f_i + rho/2 ||x - z_i + u_i||^2,
then the z- and u-steps through the communicator.

Outputs (DESIGN.md section 7) are written by :meth:`Trainer.finish`;
checkpoints by :meth:`Trainer.checkpoint` (see :mod:`admm_dist.training.checkpoint`).
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch
from safetensors.torch import save as st_save

from admm_dist.training import checkpoint as ckpt
from admm_dist.data import fitset as fs
from admm_dist.model import objectives as obj
from admm_dist import tasks
from admm_dist.model.adapter import (
    AdapterConfig, BOnlyLoRA, check_same_basis, hash_to_int64_row, int64_row_to_hash, load_vector,
    save_vector)
from admm_dist.engine.admm import ADMMEngine, RoundRecord
from admm_dist.training.checkpoint import CheckpointError
from admm_dist.mas.collection import chain_runner, collect_fitset, collect_key, gather_json, load_seat_models
from admm_dist.engine.comm import Communicator, make_communicator
from admm_dist.core.config_file import dump_yaml
from admm_dist.engine.dist import DistContext
from admm_dist.core.io import atomic_write_bytes, atomic_write_json
from admm_dist.engine.preemption import PreemptionFlag
from admm_dist.training.config import TrainConfig
from admm_dist.model.loading import load_model


class TrainError(RuntimeError):
    """A run cannot proceed; the message says why and what to change."""


@dataclasses.dataclass
class NodeState:
    node: int
    encoded: list
    sampler: Optional["obj.RoleBalancedSampler"]   # None: no examples (f_i = 0)
    optimizer: torch.optim.Optimizer


def file_fingerprint(path: Optional[str]) -> str:
    """First 12 hex digits of a file's sha256 ("none" without a file)."""
    if not path:
        return "none"
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def collect_settings(cfg: TrainConfig) -> Dict[str, object]:
    """The settings a fit set must have been built under to train this run."""
    return {"task": cfg.task, "n_agents": cfg.n_agents, "adapt_roles": cfg.adapt_roles}


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, log: Callable[[str], None] = print,
                 preempt: Optional[PreemptionFlag] = None):
        self.cfg = cfg
        self.preempt = preempt   # None: train() notes SIGUSR2 itself while it runs
        self.ctx = ctx
        self.rank = ctx.rank
        self.talk = (lambda m: None) if (cfg.quiet or ctx.rank != 0) else log
        self.report: Dict[str, object] = {"config": cfg.as_dict()}
        self._agent_models = None   # agent_models backbones, loaded at the first collection
        self._generator = None      # generation_backend vllm: this rank's engine, built at the first collection
        self._generator_dir = ""
        self.fit_digest: Optional[str] = None   # content of the first fit set (fingerprint)
        self.t_start = time.time()

    # ------------------------------------------------------------------ set-up
    def build_comm(self) -> Communicator:
        cfg, ctx = self.cfg, self.ctx
        n = cfg.n_nodes()
        if ctx.env.is_distributed:
            if cfg.backend == "local":
                raise TrainError("--backend local runs every node in one process: launch it "
                                 "without torchrun (python -m admm_dist.train ...)")
            if ctx.world_size != n:
                hosts = int(os.environ.get("GROUP_WORLD_SIZE") or os.environ.get("SLURM_JOB_NUM_NODES") or 1)
                if hosts > 1:
                    fix = (f"nodes x ranks per node must equal {n}: e.g. --nnodes {hosts} --nproc_per_node "
                           f"{n // hosts}" if n % hosts == 0 else
                           f"{n} nodes do not split over {hosts} hosts: use a host count that divides {n}")
                else:
                    fix = f"launch with torchrun --nproc_per_node {n}"
                raise TrainError(f"world size {ctx.world_size} != number of nodes {n} (one rank per node, "
                                 f"{hosts} host(s)): {fix} (on SLURM: sbatch --nodes A with NPROC_PER_NODE=B, "
                                 f"A x B = {n})")
            backend = "process_group"
        else:
            if cfg.backend == "process_group":
                raise TrainError("--backend process_group needs torchrun: torchrun "
                                 f"--nproc_per_node {n} -m admm_dist.train ...")
            backend = "local"
        return make_communicator(cfg.consensus, n_nodes=n, topology=cfg.topology,
                                 gossip_steps=cfg.gossip_steps, timeout=ctx.timeout,
                                 backend=backend)

    def load_backbone(self):
        """The backbone and tokenizer (bf16 on GPU, fp32 on CPU), through the one loader."""
        try:
            model, tok = load_model(self.cfg.model_name, self.ctx.device)
        except ValueError as e:
            raise TrainError(str(e)) from None
        model.config.use_cache = False
        return model, tok

    def setup(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.comm = self.build_comm()
        self.nodes = list(self.comm.nodes)
        self.check_outputs()
        collecting = self.needs_collection()
        if not collecting:  # a bad fit set fails before any weights load
            self.shards, self.dev_set = self.load_data(self.read_fitset())
        model, self.tokenizer = self.load_backbone()
        self.adapter = BOnlyLoRA(model, AdapterConfig(
            lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
            lora_layers_last=cfg.lora_layers_last, lora_targets=cfg.lora_targets,
            lora_basis_seed=cfg.basis_seed))
        self.model = self.adapter.model
        # Checkpointing trades compute for activation memory: on by default on GPU; a CPU
        # run has the memory and would only pay the recomputation (about +50% per step).
        if not cfg.no_grad_checkpointing and self.ctx.device.type == "cuda":
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.enable_input_require_grads()
        self._check_basis()
        self.ocfg = obj.ObjectiveConfig(
            fit_mode=cfg.fit_mode, dpo_beta=cfg.dpo_beta, kl_beta=cfg.kl_beta,
            target_span=cfg.target_span, max_prompt_tokens=cfg.max_prompt_tokens,
            max_target_tokens=cfg.max_target_tokens)
        self.init_vec = None
        if cfg.init_state:
            self.init_vec, _ = load_vector(cfg.init_state, self.adapter)
        if collecting:
            states = {} if self.init_vec is None else {s: self.init_vec for s in cfg.adapted_seats()}
            self.shards, self.dev_set = self.load_data(self.collect(0, states))
        # What a checkpoint must match to be this run's: the settings that change what is
        # computed, the fit set's content (not its path) and the initial state's bytes.
        self.fingerprint = fs.settings_key({"settings": cfg.fingerprint(), "fitset": self.fit_digest,
                                            "init_state": file_fingerprint(cfg.init_state)})[:16]

    # ------------------------------------------------------------------ outputs, before any work
    def check_outputs(self) -> None:
        """Every output path is writable, and a fresh run does not mix with another run's files.

        Runs before any weights load. A fresh run (``resume=never``) into an ``out`` that holds
        checkpoints or results is refused unless ``overwrite=true`` (then the checkpoints go at
        once and the results when this run's replace them); ``resume=auto`` with results but no
        checkpoints is refused the same way. Every rank checks, and every rank stops on the
        first problem any rank found.
        """
        cfg = self.cfg
        problem = self._output_problem()
        table = self.comm.gather_rows(torch.tensor([[float(problem is not None)]] * len(self.nodes),
                                                   dtype=torch.float64))
        if problem is not None:
            raise TrainError(problem)
        if table.max().item() > 0:
            raise TrainError("another rank found a problem with the output paths (see its message)")
        if cfg.overwrite and self.rank == 0 and os.path.isdir(ckpt.ckpt_root(cfg.out)):
            ckpt.remove_all(ckpt.ckpt_root(cfg.out))
            self.talk(f"overwrite: removed the checkpoints in {ckpt.ckpt_root(cfg.out)}")
        if cfg.overwrite:
            self.comm.gather_rows(torch.zeros(len(self.nodes), 1, dtype=torch.float64))  # removal seen by all

    def _output_problem(self) -> Optional[str]:
        cfg = self.cfg
        out, root = cfg.out, ckpt.ckpt_root(cfg.out)
        folders = {"out": out, "the checkpoint folder": root, "report_dir": cfg.report_dir,
                   "the folder of out": os.path.dirname(os.path.abspath(out))}
        for what, folder in folders.items():
            fix = "report_dir=" if what == "report_dir" else "out="
            if os.path.exists(folder) and not os.path.isdir(folder):
                return f"{what} {folder} exists and is not a folder: choose another {fix}"
            here = os.path.abspath(folder)   # nothing is created yet: the nearest existing folder decides
            while not os.path.exists(here):
                here = os.path.dirname(here)
            if not os.path.isdir(here):
                return f"{what} {folder} cannot be created: {here} is a file; choose another {fix}"
            if not os.access(here, os.W_OK | os.X_OK):
                return f"cannot write to {what} {folder} ({here} is read-only or not ours): choose a writable {fix}"
        for path, kind in ((out + "-last.safetensors", "file"), (out + "-best.safetensors", "file"),
                           (out + "-last-peft", "folder")):
            if os.path.exists(path) and (os.path.isdir(path) != (kind == "folder")):
                return f"{path} exists and is not a {kind}: move it away or choose another out="
        if cfg.dry_run or cfg.overwrite:
            return None
        rounds = ckpt.all_rounds(root)
        results = [p for p in (out + "-last.safetensors", os.path.join(out, "seat_map.json"))
                   if os.path.exists(p)]
        if cfg.resume == "never" and (rounds or results):
            held = f"checkpoints up to round {rounds[-1]}" if rounds else f"the results {results[0]}"
            return (f"out={out} already holds a run ({held}): continue it with resume=auto, replace it "
                    "with overwrite=true, or choose a new out=")
        if cfg.resume == "auto" and results and not rounds:
            return (f"out={out} holds the results of a finished run ({results[0]}) and no checkpoints to "
                    "resume: replace it with overwrite=true, or choose a new out=")
        return None

    def _check_basis(self) -> None:
        rows = torch.cat([hash_to_int64_row(self.adapter.basis_hash())] * len(self.nodes))
        table = self.comm.gather_rows(rows)
        check_same_basis([int64_row_to_hash(table[i:i + 1]) for i in range(table.shape[0])])

    # ------------------------------------------------------------------ data
    def needs_collection(self) -> bool:
        """Collect on-policy unless a fit set is given (or cached from an earlier run)."""
        cfg = self.cfg
        if cfg.fitset_cache and os.path.exists(cfg.fitset_cache):
            return False
        if cfg.task not in tasks.REGISTRY:
            if cfg.fitset_cache:
                raise TrainError(f"--fitset_cache {cfg.fitset_cache} does not exist, and task {cfg.task!r} is not "
                                 f"one to collect on-policy from: fix the path, or pass --task one of "
                                 f"{', '.join(sorted(tasks.REGISTRY))}")
            raise TrainError("no fit set: pass --fitset_cache PATH (a file written by admm_dist.data.fitset, "
                             "tools/build_fitset or an earlier collection), or --task NAME to collect on-policy")
        if cfg.reward == "judge":
            raise TrainError(f"--reward judge needs a judged fit set and {cfg.fitset_cache or 'no --fitset_cache'} "
                             "does not exist: build it with admm_dist.cli.build_fitset + judge_fitset")
        tasks.get(cfg.task)
        return True

    def read_fitset(self) -> "fs.FitSet":
        cfg = self.cfg
        f = fs.load_fitset(cfg.fitset_cache)
        if f.settings.get("sampling_structure") == "on_policy":
            want = collect_key(cfg, init_sha=file_fingerprint(cfg.init_state))
            diff = fs.settings_diff(f.settings, want, ignore=("fit_mode", "collection"))
        else:   # synthetic or built from stored trajectories: the seat layout must match
            diff = fs.settings_diff(f.settings, collect_settings(cfg),
                                    ignore=("fit_mode", "sampling_structure", "judge", "judge_fingerprint"))
        if cfg.reward == "judge" and f.settings.get("sampling_structure") == "actual_trajectory" \
                and not f.settings.get("judge_fingerprint"):
            raise TrainError(f"{cfg.fitset_cache} carries no judge labels: run admm_dist.cli.judge_fitset on it first")
        if diff:
            raise TrainError(f"--fitset_cache {cfg.fitset_cache} was built with different settings "
                             f"(file, requested): {diff}; collect again (remove the file) or match them")
        self.report.update(fitset_provenance="file")
        self.fit_digest = fs.content_key(f)
        return f

    def collect(self, collection: int, states: Dict[int, torch.Tensor]) -> "fs.FitSet":
        """Roll out the MAS on this collection's training queries (every rank a share)."""
        cfg = self.cfg
        distributed = self.ctx.env.is_distributed
        was_training = self.model.training
        self.model.eval()
        try:
            if self._agent_models is None:
                self._agent_models = load_seat_models(cfg.seat_backbones(), self.ctx.device)
            runner = chain_runner(cfg, self.model, self.tokenizer, adapter=self.adapter, states=states,
                                  seat_models=self._agent_models, generator=self.generator())
            f = collect_fitset(cfg, runner, collection=collection, init_sha=file_fingerprint(cfg.init_state),
                               rank=self.rank if distributed else 0,
                               world=self.comm.n_nodes if distributed else 1,
                               exchange=gather_json(self.comm, self.ctx.device) if distributed else None)
        except ValueError as e:
            raise TrainError(str(e)) from None
        finally:
            self.model.train(was_training)
        stats = f.stats
        self.report.setdefault("collections", []).append(
            {k: v for k, v in stats.items() if k != "per_group_outcomes"})
        keys = self.report.setdefault("anchor_keys_all", [])
        seen = set(keys)
        keys += [k for k in f.anchor_keys if k not in seen]
        self.talk(f"collection {collection}: {stats['kept_queries']}/{stats['queries']} queries x {cfg.group} "
                  f"({cfg.credit}), {len(f.examples)} examples, pass rate {stats['mean_pass_rate']:.3f}, "
                  f"mixed groups {stats['mixed_group_rate']:.3f} ({stats['seconds']}s)")
        if collection == 0 and cfg.fitset_cache and self.rank == 0:
            fs.save_fitset(cfg.fitset_cache, f.examples, fit_mode="sft", settings=f.settings, stats=stats,
                           anchor_keys=f.anchor_keys)
            self.talk(f"wrote the collected fit set to {cfg.fitset_cache}")
        self.report.update(fitset_provenance="collected")
        if collection == 0:
            self.fit_digest = fs.content_key(f)
        return f

    def load_data(self, f: "fs.FitSet"):
        cfg = self.cfg
        examples = fs.derive(f, cfg.fit_mode)
        seats = cfg.adapted_seats()
        keys = self.report.get("anchor_keys_all") or list(f.anchor_keys)
        self.report.update(fitset=cfg.fitset_cache,
                           fitset_settings_key=fs.settings_key(f.settings),
                           fitset_settings=f.settings, collection=f.stats,
                           anchor_keys=keys,
                           adapted_seats=seats, adapted_roles=[cfg.role(s) for s in seats])
        if cfg.fit_filter == "drop_unclosed_think":
            examples, dropped = fs.drop_unclosed_think(examples)
            self.report["dropped_unclosed_think"] = dropped
        outside = sorted({e.seat for e in examples if not 0 <= e.seat < cfg.n_agents})
        if outside:
            raise TrainError(f"{cfg.fitset_cache or 'the fit set'} holds examples of seat(s) {outside}, outside the "
                             f"chain of n_agents={cfg.n_agents} seats (0..{cfg.n_agents - 1}): rebuild it for this "
                             "chain, or set n_agents to the chain it was built for")
        others = sum(1 for e in examples if e.seat not in seats)
        if others:   # seats this run does not adapt (adapt_roles): documented, and said once
            self.report["dropped_unadapted_seats"] = others
            self.talk(f"note: {others} examples belong to seats this run does not adapt (adapt_roles="
                      f"{cfg.adapt_roles}): not trained on")
        per_seat = fs.by_seat(examples, seats, drop_others=True)
        if cfg.dedup_targets > 0:
            flat = fs.dedup_targets([e for s in per_seat for e in s], cfg.dedup_targets)
            per_seat = fs.by_seat(flat, seats)
        self.report["target_composition"] = fs.target_composition(per_seat)
        dev: List = []
        if cfg.dev_frac > 0:
            per_seat, dev = fs.split_dev(per_seat, cfg.dev_frac, cfg.seed)
            self.report["dev_held_out"] = len(dev)
        parts = fs.partition(per_seat, mode=cfg.partition, n_partitions=cfg.n_partitions,
                             pooled=cfg.pooled)
        self.report["node_sizes"] = [len(p) for p in parts]
        if not any(parts):
            raise TrainError(f"no training examples in {cfg.fitset_cache or 'the collected fit set'} for "
                             f"seats {seats}: refusing to train (with on-policy collection: more --anchors, "
                             "a larger --group or a wider --anchor_pass_band)")
        empty = [i for i, p in enumerate(parts) if len(p) == 0]
        if empty and cfg.empty_nodes == "error":
            raise TrainError(f"node(s) {empty} have no training examples: adapt fewer roles "
                             "(--adapt_roles), use --pooled, or --empty_nodes prox (such a node "
                             "has f_i = 0 and only follows the consensus)")
        self.report["empty_nodes"] = empty
        small = [i for i, p in enumerate(parts) if 0 < len(p) < cfg.batch_size]
        if small:
            self.talk(f"note: node(s) {small} hold fewer examples ({[len(parts[i]) for i in small]}) than "
                      f"batch_size={cfg.batch_size}: each of their steps uses the whole shard")
        self.talk(f"fit set {cfg.fitset_cache or '(collected)'}: node sizes {[len(p) for p in parts]}, "
                  f"dev {len(dev)}")
        return {n: parts[n] for n in self.nodes}, dev

    # ------------------------------------------------------------------ nodes
    def build_nodes(self) -> None:
        cfg = self.cfg
        self.state: Dict[int, NodeState] = {}
        for node in self.nodes:
            opt = torch.optim.Adam([self.adapter.param], lr=cfg.eta, foreach=False)
            self.state[node] = NodeState(node, [], None, opt)
        self.encode_nodes()
        x0 = self.init_vec if self.init_vec is not None else torch.zeros(self.adapter.numel)
        self.engine = ADMMEngine(self.comm, cfg.admm_config(),
                                 [x0.to(self.ctx.device, torch.float32) for _ in self.nodes])
        self.best = None

    def encode_nodes(self) -> None:
        """Tokenize each node's shard, compute its reference log-probs, (re)start its sampler."""
        cfg = self.cfg
        for node in self.nodes:
            if not self.shards[node]:    # f_i = 0 (empty_nodes prox): nothing to encode
                self.state[node].encoded, self.state[node].sampler = [], None
                continue
            enc = obj.encode(self.tokenizer, self.shards[node], self.ocfg)
            if not enc:
                raise TrainError(f"node {node}: every example became empty after truncation: "
                                 "raise --max_target_tokens")
            self._check_context(enc)
            self._reference(enc)
            st = self.state[node]
            st.encoded = enc
            st.sampler = obj.RoleBalancedSampler(enc, cfg.batch_size, cfg.seed * 1009 + node,
                                                 balance=not cfg.no_role_balance)

    def _check_context(self, enc) -> None:
        """An example longer than the backbone's positions is refused, naming the lengths."""
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if not isinstance(positions, int):
            return
        longest = max(len(p) + len(t) for e in enc for p, t, _, _ in e.rows())
        if longest > positions:
            raise TrainError(f"an example is {longest} tokens (prompt + target) but {self.cfg.model_name} has "
                             f"{positions} positions (max_position_embeddings): lower max_prompt_tokens "
                             f"(now {self.cfg.max_prompt_tokens}) or max_target_tokens (now "
                             f"{self.cfg.max_target_tokens})")

    def recollect(self, collection: int) -> None:
        """Fresh queries under the current consensus adapter (this rank's z) on every seat."""
        z = self.engine.z[0].detach().clone()
        self.shards, self.dev_set = self.load_data(
            self.collect(collection, {s: z for s in self.cfg.adapted_seats()}))
        self.encode_nodes()

    def _reference(self, enc) -> None:
        """Reference log-probs, once per example: adapters off, or the warm-start adapter."""
        bs = max(1, self.cfg.batch_size)
        if self.cfg.kl_ref == "collect" and self.init_vec is not None:
            self.adapter.load_vector(self.init_vec)
            ctx = _null_context(self.model)
        else:
            ctx = lambda: self.adapter.disabled()  # noqa: E731
        obj.precompute_reference(self.model, enc, batch_size=bs, ref_context=ctx,
                                 pad_id=self.tokenizer.pad_token_id)

    # ------------------------------------------------------------------ x-step
    def xstep(self, node: int, x: torch.Tensor, anchor: Optional[torch.Tensor], rho: float) -> float:
        cfg, st, ad = self.cfg, self.state[node], self.adapter
        if st.sampler is None:
            # f_i = 0: the x-step's exact minimizer of rho/2 ||x - (z_i - u_i)||^2
            if anchor is not None:
                x.copy_(anchor)
            return 0.0
        ad.load_vector(x)
        self.model.train()
        total = 0.0
        for step in range(cfg.local_steps):
            idx = st.sampler.next_batch()
            batch = obj.collate([st.encoded[i] for i in idx], self.tokenizer.pad_token_id)
            ad.zero_grad()
            loss, _ = obj.loss(self.model, batch, self.ocfg)
            value = loss.item()
            if self._fault("nan", node):
                value = float("nan")
            total += value
            if not math.isfinite(value):
                break  # every rank stops at this round's telemetry, with the node named
            loss.backward()
            if anchor is not None and rho > 0:
                ad.flat_grad.add_(ad.flat - anchor, alpha=rho)
            torch.nn.utils.clip_grad_norm_([ad.param], cfg.grad_clip)
            st.optimizer.step()
        x.copy_(ad.vector())
        return total / cfg.local_steps

    def _fault(self, kind: str, node: int) -> bool:
        """Test-only fault hook: ``fault_at`` = ROUND:NODE kills, nan@ROUND:NODE poisons f_i."""
        spec = self.cfg.fault_at
        if not spec:
            return False
        want_nan = spec.startswith("nan@")
        k, n = (int(v) for v in spec.split("@")[-1].split(":"))
        if (kind == "nan") != want_nan or n != node:
            return False
        if kind == "nan":
            return self.engine.round == k
        return self.engine.round == k and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0

    # ------------------------------------------------------------------ rounds
    def train(self) -> Dict[str, object]:
        restore = lambda: None  # noqa: E731
        if self.preempt is None:   # train.main installs it before anything else
            self.preempt = PreemptionFlag()
            restore = self.preempt.install()
        try:
            return self._train()
        finally:
            restore()
            self.close_generator()

    def generator(self):
        """The rollout engine of ``generation_backend`` (None: transformers' generate)."""
        cfg = self.cfg
        if cfg.generation_backend == "hf" or self._generator is not None:
            return self._generator
        from admm_dist.mas.vllm_backend import VLLMBackend

        self.talk(f"starting a vLLM engine on every rank ({cfg.model_name}, LoRA rank {cfg.lora_rank})")
        self._generator_dir = tempfile.mkdtemp(prefix=f"admm_dist-vllm-rank{self.rank}-")
        self._generator = VLLMBackend(
            cfg.model_name, self.tokenizer, self.adapter, workdir=self._generator_dir,
            seed=cfg.seed + self.rank, max_model_len=cfg.vllm_max_model_len,
            kv_cache_gib=cfg.vllm_kv_cache_gib, gpu_memory_utilization=cfg.vllm_gpu_memory_utilization)
        return self._generator

    def close_generator(self) -> None:
        if self._generator is not None:
            try:
                self._generator.close()
            finally:
                self._generator = None
                shutil.rmtree(self._generator_dir, ignore_errors=True)

    def _train(self) -> Dict[str, object]:
        cfg = self.cfg
        self.setup()
        self.build_nodes()
        self.report["n_nodes"] = self.comm.n_nodes
        self.report["numel"] = self.adapter.numel
        self.report["basis_hash"] = self.adapter.basis_hash()
        if cfg.dry_run:
            self.talk("dry run: fit sets built, stopping before any gradient step")
            self.write_report("dryrun")
            return self.report
        if cfg.resume == "auto":
            self.try_resume()
        root = ckpt.ckpt_root(cfg.out)
        if self._agree_preempt():   # the warning came while loading, collecting or resuming
            raise Preempted(self.engine.round, in_setup=True)
        while self.engine.round < cfg.k_outer:
            rec = self.engine.step(self.xstep)
            self.on_round(rec)
            if cfg.recollect_every and self.engine.round % cfg.recollect_every == 0 \
                    and self.engine.round < cfg.k_outer:
                self.recollect(self.engine.round // cfg.recollect_every)
            stop = self.engine.round < cfg.k_outer and self._agree_preempt()
            if stop or self.engine.round % cfg.checkpoint_every == 0 or self.engine.round == cfg.k_outer:
                self.checkpoint(root)
            if stop:
                self.report["preempted_after_round"] = self.engine.round
                self.write_report("preempted")
                raise Preempted(self.engine.round)
            if any(self._fault("kill", n) for n in self.nodes):
                os._exit(17)
        return self.finish()   # a warning from here on is ignored: the run is finishing

    def _agree_preempt(self) -> bool:
        """True on every rank if SIGUSR2 reached any rank (one tiny gather per round)."""
        flag = torch.tensor([[float(self.preempt.noted)]] * len(self.nodes), dtype=torch.float64)
        return bool(self.comm.gather_rows(flag).max().item() > 0)

    def on_round(self, rec: RoundRecord) -> None:
        cfg = self.cfg
        k = rec.round
        if self.dev_set and (k % cfg.dev_every == 0 or k == cfg.k_outer) and not cfg.local_only:
            nll = self.dev_nll()
            rec_dev = {"round": k, "dev_nll": nll}
            self.report.setdefault("dev_curve", []).append(rec_dev)
            if self.best is None or nll < self.best[0]:
                self.best = (nll, k, self.engine.z[0].detach().clone())
        self.talk(f"round {k:3d}/{cfg.k_outer}  f={[round(v, 4) for v in rec.f]}  "
                  f"primal={max(rec.primal_normalized):.3e}  dual={max(rec.dual):.3e}  "
                  + (f"rho={rec.rho:.3g}->{self.engine.rho:.3g}  " if cfg.rho_adapt else "") +
                  f"sent={max(rec.bytes_sent)} B  x-step {max(rec.sec_x):.2f}s "
                  f"z-step {max(rec.sec_z):.3f}s")

    def dev_nll(self) -> float:
        """Mean target-token NLL of each node's z_i on its share of the held-out set."""
        rows = []
        for k, node in enumerate(self.nodes):
            share = self.dev_set[node::self.comm.n_nodes]
            self.adapter.load_vector(self.engine.z[k])
            rows.append(list(self._nll_sum(node, share)))
        table = self.comm.gather_rows(torch.tensor(rows, dtype=torch.float64))
        return float(table[:, 0].sum() / table[:, 1].sum().clamp_min(1))

    def _nll_sum(self, node: int, examples) -> tuple:
        """(sum of target-token NLL, number of tokens) of the current adapter, no grad."""
        if not examples:
            return 0.0, 0.0
        cache = self.__dict__.setdefault("_dev_encoded", {})
        if node not in cache:  # the held-out share is fixed: tokenize it once
            cache[node] = obj.encode(self.tokenizer, examples, self.ocfg)
        enc = cache[node]
        tot = cnt = 0.0
        self.model.eval()
        with torch.no_grad():
            for batch in obj.batches(enc, self.cfg.batch_size, self.tokenizer.pad_token_id):
                b = batch.chosen()
                lp = obj.token_logps(self.model, b)
                m = b.target_mask.to(lp.device)
                tot += float(-(lp * m).sum())
                cnt += float(m.sum())
        self.model.train()
        return tot, cnt

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, root: str) -> None:
        k = self.engine.round
        fp = self.fingerprint
        history = [r.as_dict() for r in self.engine.history]
        for j, node in enumerate(self.nodes):
            st = self.state[node]
            opt_state = st.optimizer.state.get(self.adapter.param, {})
            tensors = {"x": self.engine.x[j], "z": self.engine.z[j], "u": self.engine.u[j],
                       "rng_cpu": torch.get_rng_state()}
            for key in ("exp_avg", "exp_avg_sq"):
                if key in opt_state:
                    tensors[f"adam.{key}"] = opt_state[key]
            meta = {"fingerprint": fp,
                    "adam_step": float(opt_state["step"]) if "step" in opt_state else 0.0,
                    "sampler": st.sampler.state_dict() if st.sampler else None, "history": history,
                    "dev_curve": self.report.get("dev_curve", []),
                    "rho": self.engine.state_dict()["rho"],
                    "best": None if self.best is None else [self.best[0], self.best[1]]}
            if self.best is not None:
                tensors["best_z"] = self.best[2]
            ckpt.save_node(root, k, node, tensors, meta)
        ckpt.prune(root, self.nodes, self.cfg.keep_checkpoints, fp)

    def try_resume(self) -> None:
        cfg = self.cfg
        root = ckpt.ckpt_root(cfg.out)
        mine = ckpt.completed_rounds(root, self.nodes, self.fingerprint)
        foreign = bool(ckpt.all_rounds(root)) and not mine
        row = [float(mine[-1] if mine else 0), float(foreign), float(mine[-1] if mine else 0)]
        table = self.comm.gather_rows(torch.tensor([row] * len(self.nodes), dtype=torch.float64))
        agreed, newest = int(table[:, 0].min().item()), int(table[:, 2].max().item())
        if table[:, 1].max().item() > 0 and agreed == 0:
            raise CheckpointError(
                f"resume auto: the checkpoints in {root} were written by another run (other settings, fit set "
                "or initial state): resume with that run's settings, replace it with overwrite=true "
                "(resume=never), or choose a new out=")
        if newest > cfg.k_outer:
            raise CheckpointError(
                f"resume auto: the checkpoints in {root} reach round {newest}, beyond k_outer={cfg.k_outer}: "
                f"pass k_outer={newest} or more to continue that run, or choose a new out=")
        if agreed == 0:
            self.talk("resume auto: no complete checkpoint on every rank; starting from round 0")
            return
        if agreed not in mine:
            raise TrainError(f"resume auto: round {agreed} is the last every rank completed but rank "
                             f"{self.rank} no longer has it (--keep_checkpoints too small)")
        state: Dict[str, object] = {"round": agreed}
        loaded = {}
        for node in self.nodes:
            tensors, meta = ckpt.load_node(root, agreed, node, self.fingerprint)
            loaded[node] = (tensors, meta)
            state["rho"] = meta.get("rho", self.cfg.rho)
            for name in ("x", "z", "u"):
                state[f"{name}.{node}"] = tensors[name].to(self.ctx.device)
        self.engine.load_state_dict(state)
        every = self.cfg.recollect_every
        if every and agreed >= every and agreed < self.cfg.k_outer:
            self.recollect(agreed // every)   # deterministic: the same z gives the same rollouts
        for node, (tensors, meta) in loaded.items():
            st = self.state[node]
            if "adam.exp_avg" in tensors:
                st.optimizer.state[self.adapter.param] = {
                    "step": torch.tensor(meta["adam_step"]),
                    "exp_avg": tensors["adam.exp_avg"].to(self.ctx.device),
                    "exp_avg_sq": tensors["adam.exp_avg_sq"].to(self.ctx.device)}
            if st.sampler is not None and meta["sampler"] is not None:
                st.sampler.load_state_dict(meta["sampler"])
            torch.set_rng_state(tensors["rng_cpu"])
            self.engine.history = [RoundRecord(**r) for r in meta["history"]]
            if meta.get("dev_curve"):
                self.report["dev_curve"] = meta["dev_curve"]
            if meta.get("best") is not None:
                self.best = (meta["best"][0], meta["best"][1], tensors["best_z"].to(self.ctx.device))
        self.talk(f"resume auto: continuing after round {agreed}")

    # ------------------------------------------------------------------ outputs
    @torch.no_grad()
    def delta_w_rel(self, vec: torch.Tensor) -> float:
        """||sum of scaled B A|| / ||W|| over the adapted projections."""
        self.adapter.load_vector(vec)
        num = den = 0.0
        scale = self.cfg.lora_alpha / self.cfg.lora_rank
        base = self.model.get_base_model()
        for name, _shape, _off in self.adapter.layout():
            mod = base.get_submodule(name)
            a = mod.lora_A["default"].weight.float()
            b = mod.lora_B["default"].weight.float()
            num += float((scale * (b @ a)).pow(2).sum())
            den += float(mod.base_layer.weight.float().pow(2).sum())
        return math.sqrt(num) / max(math.sqrt(den), 1e-30)

    def finish(self) -> Dict[str, object]:
        cfg = self.cfg
        hist = self.engine.history
        self.report.update(
            rounds=[r.as_dict() for r in hist],
            loss_curve=[r.f for r in hist],
            normalized_primal_residual_curve=[r.primal_normalized for r in hist],
            x1_norm_curve=[r.x1_norm for r in hist],
            comm_bytes_per_round_per_node=[r.bytes_sent for r in hist],
            backend=self.comm.__class__.__name__, train_sec=round(time.time() - self.t_start, 2))
        deploy_local = cfg.local_only or not self.comm.exact
        result = [self.engine.x[j] if cfg.local_only else self.engine.z[j]
                  for j in range(len(self.nodes))]
        dw = [self.delta_w_rel(v) for v in result]
        dws = self.comm.gather_rows(torch.tensor([[d] for d in dw], dtype=torch.float64))
        dw_all = [float(v) for v in dws[:, 0]]
        self.report["delta_w_rel"] = dw_all if deploy_local else dw_all[0]
        self.report["deploy_required"] = "local" if deploy_local else None
        # Every node should move, except under local_only a node with no examples (f_i = 0,
        # nothing couples it to the others): its x_i staying at x^0 is the right answer.
        sizes = self.report.get("node_sizes") or [1] * len(dw_all)
        should = [i for i, d in enumerate(dw_all) if not (cfg.local_only and sizes[i] == 0)]
        still = [i for i in should if not (math.isfinite(dw_all[i]) and dw_all[i] >= 1e-6)]
        kept = "; any earlier result in out= is kept"
        if still or not should:
            self.write_report("refused")
            raise TrainError(f"refusing to write {cfg.out}: the adapter of node(s) {still or should} did not "
                             f"move (delta_w_rel={dw_all}); raise --eta or --k_outer{kept}")
        wild = [i for i, d in enumerate(dw_all) if d > cfg.max_delta_w_rel]
        if wild:
            self.write_report("refused")
            raise TrainError(f"refusing to write {cfg.out}: the run diverged (delta_w_rel of node(s) {wild} = "
                             f"{max(dw_all[i] for i in wild):.3g} > max_delta_w_rel={cfg.max_delta_w_rel:g}): "
                             f"lower --eta or --grad_clip{kept}")
        self.write_outputs(deploy_local)
        self.write_report()
        return self.report

    def write_outputs(self, deploy_local: bool) -> None:
        cfg = self.cfg
        meta = {"config": cfg.as_dict(), "seats": cfg.adapted_seats(),
                "roles": [cfg.role(s) for s in cfg.adapted_seats()],
                "n_nodes": self.comm.n_nodes}
        for j, node in enumerate(self.nodes):
            path = os.path.join(cfg.out, f"node-{node}.safetensors")
            atomic_write_bytes(path, st_save({k: v.detach().cpu().contiguous() for k, v in
                                              (("x", self.engine.x[j]), ("z", self.engine.z[j]),
                                               ("u", self.engine.u[j]))}))
        if self.rank != 0:
            return
        for stale in (k for k in self._node_files() if k >= self.comm.n_nodes):   # an overwritten run's extras
            os.unlink(os.path.join(cfg.out, f"node-{stale}.safetensors"))
        atomic_write_json(os.path.join(cfg.out, "seat_map.json"),
                          dict(meta, deploy_required="local" if deploy_local else None,
                               anchor_keys=list(self.report.get("anchor_keys") or []),
                               node_of_seat={str(s): (0 if cfg.pooled else i)
                                             for i, s in enumerate(cfg.adapted_seats())}))
        atomic_write_bytes(os.path.join(cfg.out, "config.yaml"), dump_yaml(cfg).encode())
        if cfg.local_only:
            self.talk(f"wrote {cfg.out}/ (local-only: deploy each node's x_i per seat)")
            return
        z = self.engine.z[0]
        # A copied adapter keeps the leakage check: it carries the training queries' keys.
        trained_on = {"anchor_keys": list(self.report.get("anchor_keys") or []),
                      "report": os.path.abspath(self.report_path())}
        save_vector(cfg.out + "-last.safetensors", z,
                    {"selection": "final consensus variable z", "round": self.engine.round,
                     "deploy_required": "local" if deploy_local else None, **trained_on}, adapter=self.adapter)
        self.talk(f"wrote {cfg.out}-last.safetensors")
        if self.best is not None:
            save_vector(cfg.out + "-best.safetensors", self.best[2],
                        {"selection": "lowest held-out NLL", "round": self.best[1],
                         "dev_nll": self.best[0], **trained_on}, adapter=self.adapter)
            self.report["best"] = {"round": self.best[1], "dev_nll": self.best[0]}
            self.talk(f"wrote {cfg.out}-best.safetensors (round {self.best[1]})")
        if cfg.export_peft:
            self.adapter.export_peft(cfg.out + "-last-peft", z)
            self.talk(f"wrote {cfg.out}-last-peft/")

    def _node_files(self) -> List[int]:
        names = os.listdir(self.cfg.out) if os.path.isdir(self.cfg.out) else []
        return [int(n[5:-12]) for n in names if n.startswith("node-") and n.endswith(".safetensors")
                and n[5:-12].isdigit()]

    def report_path(self, kind: Optional[str] = None) -> str:
        """``<report_dir>/<name>-train.json`` describes the results in ``out``; a refused,
        preempted or dry run writes ``<name>-train-<kind>.json`` beside it, never over it."""
        name = os.path.basename(self.cfg.out)
        return os.path.join(self.cfg.report_dir, f"{name}-train{'-' + kind if kind else ''}.json")

    def write_report(self, kind: Optional[str] = None) -> None:
        if self.rank != 0:
            return
        path = self.report_path(kind)
        atomic_write_json(path, _jsonable(self.report))
        self.talk(f"wrote {path}")


def _null_context(model):
    import contextlib

    return lambda: contextlib.nullcontext(model)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x
