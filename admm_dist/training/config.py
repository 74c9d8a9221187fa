"""The training run's configuration: one flat dataclass keyed by the seed's flag names.

The flat keys stay the seed's; the components own their fields. A key that belongs to a
component (:class:`~admm_dist.engine.admm.ADMMConfig`, :class:`~admm_dist.model.adapter.AdapterConfig`,
:class:`~admm_dist.model.objectives.ObjectiveConfig`, :class:`~admm_dist.mas.chain.ChainConfig`,
:class:`~admm_dist.mas.collection.Collector`) takes its default from that component
(:func:`~admm_dist.core.config_file.default_of`), its choices from the component's list, and
its check from the component's ``__post_init__``, which :meth:`TrainConfig.__post_init__`
runs; :meth:`TrainConfig.admm_config` and its siblings are the one place the flat keys map
onto the components. The keys below are the run's own.

Defaults are the paper's safety settings (Table A2): rho 0.03, 16 local Adam
steps, lr 1e-3, clip 0.01, batch 8, beta_DPO = beta_KL = 0.1, rank-16 LoRA on
all seven projections of all 36 layers, B only. A YAML file in ``configs/``
overrides them, and the command line overrides the file
(:mod:`admm_dist.core.config_file`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any, Dict, Optional

from admm_dist.core.config_file import default_of
from admm_dist.core.constants import DEFAULT_TIMEOUT_S
from admm_dist.core.errors import UserError
from admm_dist.data.derive import FIT_FILTERS
from admm_dist.data.fitset import PARTITION_MODES
from admm_dist.engine.admm import ADMMConfig
from admm_dist.engine.comm import COMM_BACKENDS, MODES, TOPOLOGIES
from admm_dist.mas.chain import ChainConfig
from admm_dist.mas.collection import CREDITS, REWARDS, Collector
from admm_dist.mas.prompts import prompt_modes, role_name
from admm_dist.mas.seats import GENERATION_BACKENDS, ROLE_SETS, adapted_seats, parse_agent_models
from admm_dist.model.adapter import AdapterConfig
from admm_dist.model.objectives import KL_REFS, ObjectiveConfig
from admm_dist.training.tracking import TrackingConfig

# Keys that do not change what is computed: a checkpoint or a fit set made under
# other values of these is still valid.
NON_SEMANTIC = frozenset({
    "out", "report_dir", "quiet", "resume", "checkpoint_every", "keep_checkpoints",
    "k_outer", "timeout_s", "export_peft", "dry_run", "backend", "device", "dev_every",
    "gen_batch_size", "overwrite", "max_delta_w_rel",
    "vllm_max_model_len", "vllm_kv_cache_gib", "vllm_gpu_memory_utilization",
    "report_to", "tracking_dir", "wandb_project", "wandb_mode",
})
# Keys added after checkpoints were first written, with the value that reproduces them: they
# enter the fingerprint only when set otherwise, so an older run still resumes.
LATER_KEYS = {"generation_backend": "hf"}
EMPTY_NODES = ("error", "prox")    # empty_nodes: refuse a node without examples, or give it f_i = 0
RESUME_MODES = ("never", "auto")


def _choice(name: str, value: str, choices) -> None:
    if value not in choices:
        raise UserError(f"{name}={value!r}: choose one of {', '.join(map(str, choices))}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # system
    task: str = "fitset"
    model_name: str = "Qwen/Qwen3-8B"
    device: str = "auto"
    seed: int = 42
    n_agents: int = default_of(ChainConfig, "n_agents")
    adapt_roles: str = "all"
    backend: str = "auto"           # COMM_BACKENDS: auto | process_group | local
    timeout_s: float = DEFAULT_TIMEOUT_S   # bound on every collective

    # the multi-agent system and on-policy collection (DESIGN.md section 5)
    task_path: Optional[str] = None       # local JSON/JSONL/CSV for the task instead of the hub
    prompt: str = default_of(ChainConfig, "prompt")
    fit_prompt: Optional[str] = None      # fit every message under this (deployment) prompt
    think: bool = default_of(ChainConfig, "think")
    text_mas_context_length: Optional[int] = None
    agent_models: Optional[str] = None    # "SEAT=PATH[,SEAT=PATH]": a seat on another backbone
    anchors: int = 32
    group: int = default_of(Collector, "group")
    credit: str = default_of(Collector, "credit")
    reward: str = default_of(Collector, "reward")
    anchor_split: Optional[str] = None
    anchor_offset: Optional[int] = None
    anchor_pool: Optional[int] = None
    anchor_pass_band: Optional[str] = None
    recollect_every: int = 0
    downstream_seed: int = default_of(Collector, "downstream_seed")
    prefix_samples: int = default_of(Collector, "prefix_samples")   # per_role: branch from the first right of P prefix chains
    max_new_tokens: int = default_of(ChainConfig, "max_new_tokens")
    sink_tokens: Optional[int] = default_of(ChainConfig, "sink_tokens")
    temperature: float = default_of(ChainConfig, "temperature")
    top_p: float = default_of(ChainConfig, "top_p")
    gen_batch_size: int = default_of(ChainConfig, "batch_size")   # rows per generate call (memory, not semantics)
    gen_chunk: int = default_of(Collector, "chunk")   # queries per collection work unit
    generation_backend: str = "hf"        # hf (transformers, bit-for-bit seeded) | vllm (docs/vllm.md)
    vllm_max_model_len: int = 4096        # the engine's longest prompt + reply, in tokens
    vllm_kv_cache_gib: float = 1.0        # CPU: the KV cache size (VLLM_CPU_KVCACHE_SPACE)
    vllm_gpu_memory_utilization: float = 0.5   # GPU: the engine's share (the trainer holds the rest)

    # data
    fitset_cache: Optional[str] = None
    fit_filter: str = "drop_unclosed_think"
    dedup_targets: int = 3
    dev_frac: float = 0.0
    dev_every: int = 1
    partition: str = "seat"
    empty_nodes: str = "error"      # error | prox: a node without examples has f_i = 0
    n_partitions: int = 0
    pooled: bool = False
    dry_run: bool = False
    init_state: Optional[str] = None

    # objective
    fit_mode: str = default_of(ObjectiveConfig, "fit_mode")
    dpo_beta: float = default_of(ObjectiveConfig, "dpo_beta")
    kl_beta: float = default_of(ObjectiveConfig, "kl_beta")
    kl_ref: str = "frozen"
    no_role_balance: bool = False
    target_span: str = default_of(ObjectiveConfig, "target_span")
    max_target_tokens: int = default_of(ObjectiveConfig, "max_target_tokens")
    max_prompt_tokens: int = default_of(ObjectiveConfig, "max_prompt_tokens")
    no_grad_checkpointing: bool = False

    # adapter
    lora_rank: int = default_of(AdapterConfig, "lora_rank")
    lora_alpha: float = default_of(AdapterConfig, "lora_alpha")
    lora_layers_last: int = default_of(AdapterConfig, "lora_layers_last")
    lora_targets: str = default_of(AdapterConfig, "lora_targets")
    lora_basis_seed: Optional[int] = None

    # ADMM
    k_outer: int = 20
    local_steps: int = 16
    batch_size: int = 8
    eta: float = 1e-3
    rho: float = default_of(ADMMConfig, "rho")
    grad_clip: float = 0.01
    consensus: str = "ring"
    topology: str = "ring"
    gossip_steps: int = 1
    local_only: bool = default_of(ADMMConfig, "local_only")
    no_dual: bool = default_of(ADMMConfig, "no_dual")
    rho_adapt: bool = default_of(ADMMConfig, "rho_adapt")   # residual balancing (Boyd et al. 2011, 3.4.1); duals rescaled
    rho_mu: float = default_of(ADMMConfig, "rho_mu")
    rho_tau: float = default_of(ADMMConfig, "rho_tau")

    # outputs and fault tolerance
    out: str = "runs/admm"
    report_dir: str = "results"
    quiet: bool = False
    checkpoint_every: int = 1
    keep_checkpoints: int = 3
    resume: str = "never"           # never | auto
    overwrite: bool = False         # a fresh run may replace the run already in `out`
    max_delta_w_rel: float = 10.0   # a result with ||dW||/||W|| above this diverged: refused
    export_peft: bool = False
    # experiment tracking (training/tracking.py): rank 0 logs every round's figures
    report_to: str = default_of(TrackingConfig, "report_to")         # none | tensorboard | wandb | a,b
    tracking_dir: Optional[str] = default_of(TrackingConfig, "tracking_dir")   # <report_dir>/tracking/<name>
    wandb_project: str = default_of(TrackingConfig, "wandb_project")
    wandb_mode: str = default_of(TrackingConfig, "wandb_mode")         # offline | online

    def __post_init__(self) -> None:
        # the components check their own fields (and say how to fix them)
        self.admm_config()
        self.adapter_config()
        self.objective_config()
        self.chain_config()
        self.tracking_config()
        # the run's own choices
        _choice("adapt_roles", self.adapt_roles, ROLE_SETS)
        _choice("backend", self.backend, COMM_BACKENDS)
        _choice("fit_filter", self.fit_filter, FIT_FILTERS)
        _choice("partition", self.partition, PARTITION_MODES)
        _choice("empty_nodes", self.empty_nodes, EMPTY_NODES)
        _choice("kl_ref", self.kl_ref, KL_REFS)
        _choice("consensus", self.consensus, MODES)
        _choice("topology", self.topology, TOPOLOGIES)
        _choice("resume", self.resume, RESUME_MODES)
        _choice("generation_backend", self.generation_backend, GENERATION_BACKENDS)
        if self.vllm_max_model_len < 16:
            raise UserError(f"vllm_max_model_len={self.vllm_max_model_len}: give the longest prompt + reply "
                            "in tokens (e.g. 4096)")
        if not (math.isfinite(self.vllm_kv_cache_gib) and self.vllm_kv_cache_gib > 0):
            raise UserError(f"vllm_kv_cache_gib={self.vllm_kv_cache_gib}: give a size in GiB > 0 (e.g. 1)")
        if not 0 < self.vllm_gpu_memory_utilization < 1:
            raise UserError(f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization}: give the "
                            "engine's share of GPU memory in (0, 1), e.g. 0.5")
        if self.fit_prompt is not None:
            _choice("fit_prompt", self.fit_prompt, prompt_modes())
        _choice("credit", self.credit, CREDITS)
        _choice("reward", self.reward, REWARDS)
        for name in ("anchors", "group", "gen_chunk", "prefix_samples"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)}: it must be >= 1")
        if self.prefix_samples > 1 and self.credit != "per_role":
            raise UserError(f"prefix_samples={self.prefix_samples} picks the prefix per_role credit branches "
                            "from: use --credit per_role, or prefix_samples 1")
        if self.recollect_every < 0:
            raise UserError(f"recollect_every={self.recollect_every}: use 0 (collect once) or N >= 1 rounds")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise UserError(f"temperature={self.temperature}: collection samples; use a value > 0 (e.g. 0.8)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p={self.top_p}: use a value in (0, 1]")
        if self.anchor_pool is not None and self.anchor_pool < self.anchors:
            raise UserError(f"anchor_pool={self.anchor_pool} < anchors={self.anchors}: the pool must "
                            "hold at least the queries kept")
        self.pass_band()
        self.seat_backbones()
        for name in ("k_outer", "local_steps", "batch_size", "dev_every", "checkpoint_every",
                     "keep_checkpoints", "gossip_steps"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)}: it must be >= 1")
        self._check_out()
        if self.overwrite and self.resume == "auto":
            raise UserError("overwrite=true replaces the run in out=, resume=auto continues it: choose one")
        for name in ("eta", "grad_clip", "timeout_s", "max_delta_w_rel"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise UserError(f"{name}={v}: it must be a finite number > 0")
        if not 0 <= self.dev_frac < 1:
            raise UserError(f"dev_frac={self.dev_frac}: pass a held-out fraction in [0, 1), e.g. dev_frac=0.1 "
                            "(0 holds out nothing)")
        if self.dedup_targets < 0:
            raise UserError(f"dedup_targets={self.dedup_targets}: use 0 (off) or a cap >= 1")
        if self.pooled and self.partition == "anchor":
            raise UserError("pooled puts every example on one node: drop --partition anchor")
        if self.n_partitions < 0:
            raise UserError(f"n_partitions={self.n_partitions}: use 0 (one per seat) or >= 1")

    def _check_out(self) -> None:
        """``out`` names a run (``runs/x`` -> runs/x/, runs/x-last.safetensors, ...); a trailing
        slash is dropped."""
        out = str(self.out).rstrip("/")
        if not out or os.path.basename(out) in (".", ".."):
            raise UserError(f"out={self.out!r}: name the run, e.g. out=runs/ring (its files go to runs/ring/, "
                            "runs/ring-last.safetensors and runs/ring.ckpt/)")
        object.__setattr__(self, "out", out)
        if not str(self.report_dir).strip():
            raise UserError("report_dir='': name a folder for the training report, e.g. report_dir=results")

    # -- the component configs these flat keys map onto (the one place they are mapped) --
    def admm_config(self) -> ADMMConfig:
        return ADMMConfig(rho=self.rho, local_only=self.local_only, no_dual=self.no_dual,
                          rho_adapt=self.rho_adapt, rho_mu=self.rho_mu, rho_tau=self.rho_tau)

    def adapter_config(self) -> AdapterConfig:
        return AdapterConfig(lora_rank=self.lora_rank, lora_alpha=self.lora_alpha,
                             lora_layers_last=self.lora_layers_last, lora_targets=self.lora_targets,
                             lora_basis_seed=self.basis_seed)

    def chain_config(self, words: str = "default") -> ChainConfig:
        """The chain this run collects with (``words``: the task's prompt wording)."""
        return ChainConfig(n_agents=self.n_agents, prompt=self.prompt, words=words, think=self.think,
                           context_tokens=self.text_mas_context_length, max_new_tokens=self.max_new_tokens,
                           sink_tokens=self.sink_tokens, temperature=self.temperature, top_p=self.top_p,
                           batch_size=self.gen_batch_size)

    def objective_config(self) -> ObjectiveConfig:
        return ObjectiveConfig(fit_mode=self.fit_mode, dpo_beta=self.dpo_beta, kl_beta=self.kl_beta,
                               target_span=self.target_span, max_prompt_tokens=self.max_prompt_tokens,
                               max_target_tokens=self.max_target_tokens)

    def tracking_config(self) -> TrackingConfig:
        return TrackingConfig(report_to=self.report_to, tracking_dir=self.tracking_dir,
                              wandb_project=self.wandb_project, wandb_mode=self.wandb_mode)

    @property
    def basis_seed(self) -> int:
        return self.seed if self.lora_basis_seed is None else self.lora_basis_seed

    def adapted_seats(self):
        return adapted_seats(self.adapt_roles, self.n_agents)

    def pass_band(self):
        """``anchor_pass_band`` as (lo, hi), or None."""
        if not self.anchor_pass_band:
            return None
        try:
            lo, hi = (float(x) for x in str(self.anchor_pass_band).split(","))
        except ValueError:
            raise UserError(f"anchor_pass_band={self.anchor_pass_band!r}: write LO,HI, e.g. 0,1") from None
        if not 0.0 <= lo < hi <= 1.0:
            raise UserError(f"anchor_pass_band {lo},{hi} is not 0 <= LO < HI <= 1")
        return lo, hi

    def seat_backbones(self) -> Dict[int, str]:
        """``agent_models`` as {seat: model path or hub id}."""
        return parse_agent_models(self.agent_models, self.n_agents)

    def role(self, seat: int) -> str:
        return role_name(seat)

    def n_nodes(self) -> int:
        if self.pooled:
            return 1
        if self.partition == "anchor":
            return self.n_partitions or len(self.adapted_seats())
        return len(self.adapted_seats())

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of every setting that changes what is computed (for checkpoints)."""
        d = {k: v for k, v in self.as_dict().items()
             if k not in NON_SEMANTIC and LATER_KEYS.get(k, object()) != v}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
