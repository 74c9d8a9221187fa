"""The training run's configuration: one flat dataclass keyed by the reference implementation's
flag names.

The flat keys stay the reference implementation's; the components own their fields. A key that belongs to a
component (``ADMMConfig``, ``AdapterConfig``, ``ObjectiveConfig``, ``ChainConfig``,
``TrackingConfig``, ``Collector``) is made by :func:`~admm_dist.core.config_file.from_component`:
its default, its one-line help and its choices are the component's field's, and its check is the
component's ``__post_init__``, which :meth:`TrainConfig.__post_init__` runs;
:meth:`TrainConfig.admm_config` and its siblings are the one place the flat keys map onto the
components. The run's own keys are made by :func:`~admm_dist.core.config_file.key`, with their
help and choices at the field; ``--help`` is rendered from that metadata, by :data:`GROUPS`.
A key that sizes memory or work carries its ceiling there too (``at_most``, a constant of
:mod:`admm_dist.core.constants`), checked first, under the key's own name, before anything is built.

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
import unicodedata
from typing import Any, Dict, Optional

from admm_dist import tasks
from admm_dist.data.queries import check_n_ops
from admm_dist.core.config_file import check_bounds, format_help, from_component, key, keys_by_fingerprint
from admm_dist.core.constants import (DEFAULT_TIMEOUT_S, MAX_BATCH_SIZE, MAX_GOSSIP_STEPS, MAX_KV_CACHE_GIB,
                                      MAX_LOCAL_STEPS, MAX_NODES, MAX_OPS, MAX_QUERIES, MAX_ROUNDS,
                                      MAX_SAMPLES, MAX_TIMEOUT_S, MAX_TOKENS)
from admm_dist.core.errors import UserError
from admm_dist.core.text import is_int, parse_size
from admm_dist.data.derive import FIT_FILTERS
from admm_dist.data.fitset import PARTITION_MODES
from admm_dist.engine.admm import ADMMConfig
from admm_dist.engine.comm import COMM_BACKENDS, COMPRESSIONS, MODES, TOPOLOGIES, check_mode
from admm_dist.engine.codec import check_compress
from admm_dist.engine.dist import DEVICE_FORMS, check_device
from admm_dist.mas.chain import ChainConfig
from admm_dist.mas.collection import Collector
from admm_dist.mas.prompts import prompt_modes, role_name
from admm_dist.mas.seats import GENERATION_BACKENDS, ROLE_SETS, adapted_seats, parse_agent_models
from admm_dist.model.adapter import AdapterConfig
from admm_dist.model.loading import DTYPES
from admm_dist.model.objectives import KL_REFS, ObjectiveConfig
from admm_dist.training.tracking import TrackingConfig

# Keys that name a file, a folder or a model: a control character (newline, tab, NUL, ...) or a
# leading or trailing space in one is a typo that would name another path, and is refused.
PATH_KEYS = ("model_name", "task_path", "fitset_cache", "init_state", "out", "report_dir", "tracking_dir")
EMPTY_NODES = ("error", "prox")    # empty_nodes: refuse a node without examples, or give it f_i = 0
RESUME_MODES = ("never", "auto")
# --help's groups, in order; every key names one
SYSTEM, DATA, GEN, OBJ, ADAPTER = "system", "data and rollouts", "generation (vLLM)", "objective", "adapter"
ADMM, HELD_OUT, OUT, TRACK = "ADMM", "held-out selection", "outputs and checkpoints", "tracking"
GROUPS = (SYSTEM, DATA, GEN, OBJ, ADAPTER, ADMM, HELD_OUT, OUT, TRACK)
BUILT = (ADMMConfig, AdapterConfig, ObjectiveConfig, ChainConfig, TrackingConfig)   # each checks its own


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    task: str = key("fitset", f"the task to collect on-policy from ({', '.join(sorted(tasks.REGISTRY))}); "
                    "with a pre-built --fitset_cache only a label", group=SYSTEM)
    model_name: str = key("Qwen/Qwen3-8B", "the backbone: a local folder or a hub id", group=SYSTEM)
    device: str = key("auto", f"{DEVICE_FORMS}: auto takes CUDA when present; under torchrun a rank "
                      "given cuda or auto takes cuda:LOCAL_RANK", metavar="DEVICE", group=SYSTEM,
                      fingerprint="ignored")
    dtype: str = key("auto",
                     "the backbone's weights: auto is bfloat16 on CUDA and float32 on CPU; bfloat16 on "
                     "a CPU with AVX512-BF16 collects 1.3x faster (docs/benchmarks.md)", choices=DTYPES,
                     group=SYSTEM)
    seed: int = key(42, "the run's seed: query shuffle, rollouts, minibatches and the LoRA basis",
                    group=SYSTEM)
    n_agents: int = from_component(ChainConfig, "n_agents", group=SYSTEM)
    adapt_roles: str = key("all", "seats that carry a trainable adapter: all, nonsink (all but the last), "
                           "middle (neither the first nor the last)", choices=ROLE_SETS, group=SYSTEM)
    backend: str = key("auto", "process_group (one node per torchrun rank), local (every node in this "
                       "process), auto (the group when torchrun started one)", choices=COMM_BACKENDS,
                       group=SYSTEM, fingerprint="ignored")
    timeout_s: float = key(DEFAULT_TIMEOUT_S, "bound in seconds on every collective and wait", group=SYSTEM,
                           above=0, at_most=MAX_TIMEOUT_S, fingerprint="ignored")
    plan_memory: bool = key(True, "before any weights are read, rehearse this rank's memory (as python -m "
                            "admm_dist.plan does) and refuse a job that will not fit its device, naming a "
                            "change that fits: GPU jobs, and CPU jobs given device_memory", group=SYSTEM,
                            fingerprint="ignored")
    device_memory: Optional[str] = key(None, "the memory of one device that plan_memory checks against, e.g. "
                                       "80GiB (unset: the GPU's own; a CPU job is not checked)",
                                       metavar="SIZE", group=SYSTEM, fingerprint="ignored")

    task_path: Optional[str] = key(None, "a local JSON/JSONL/CSV file of the task's rows instead of the hub",
                                   metavar="PATH", group=DATA)
    n_ops: Optional[int] = key(None, "operations per problem of chain_arith and word_arith (unset: theirs, "
                               "3 and 1)", metavar="K", group=DATA, at_most=MAX_OPS)
    prompt: str = from_component(ChainConfig, "prompt", group=DATA)
    fit_prompt: Optional[str] = key(None, "fit every message under this (deployment) prompt, keeping the "
                                    "collected message as the target (none: the collection prompt)",
                                    choices=prompt_modes(), group=DATA)
    think: bool = from_component(ChainConfig, "think", group=DATA)
    text_mas_context_length: Optional[int] = from_component(ChainConfig, "context_tokens", group=DATA)
    agent_models: Optional[str] = key(None, "run these seats on another backbone (a compromised agent); such "
                                      "a seat carries no adapter", metavar="SEAT=PATH[,SEAT=PATH]",
                                      group=DATA)
    anchors: int = key(32, "number of training queries", group=DATA, at_least=1, at_most=MAX_QUERIES)
    group: int = from_component(Collector, "group", group=DATA, at_most=MAX_SAMPLES)
    credit: str = from_component(Collector, "credit", group=DATA)
    reward: str = from_component(Collector, "reward", group=DATA)
    anchor_split: Optional[str] = key(None, "draw training queries from this split (e.g. train) instead of "
                                      "the tail of the evaluation split", metavar="SPLIT", group=DATA)
    anchor_offset: Optional[int] = key(None, "take training queries from rows [K, K + anchors) of the "
                                       "shuffled pool instead of its tail", metavar="K", group=DATA)
    anchor_pool: Optional[int] = key(None, "pre-screen: sample each of the last M candidate queries twice "
                                     "and drop those answered right both times", metavar="M", group=DATA,
                                     at_most=MAX_QUERIES)
    anchor_pass_band: Optional[str] = key(None, "keep only queries whose pass rate lies strictly inside "
                                          "(LO, HI); 0,1 keeps queries with mixed outcomes",
                                          metavar="LO,HI", group=DATA)
    recollect_every: int = key(0,
                               "collect again on fresh queries every N rounds, each seat under the adapter "
                               "it deploys now (the consensus z; its own node's state where consensus is "
                               "inexact or under local_only) (0: collect once)", group=DATA,
                               at_least=0, at_most=MAX_ROUNDS)
    recollect_anchors: Optional[int] = key(None, "queries per re-collection (default: anchors, as the first "
                                           "collection)", metavar="N", group=DATA, at_least=1,
                                           at_most=MAX_QUERIES)
    downstream_seed: int = from_component(Collector, "downstream_seed", group=DATA)
    prefix_samples: int = from_component(Collector, "prefix_samples", group=DATA, at_most=MAX_SAMPLES)
    max_new_tokens: int = from_component(ChainConfig, "max_new_tokens", group=DATA)
    sink_tokens: Optional[int] = from_component(ChainConfig, "sink_tokens", group=DATA)
    temperature: float = from_component(ChainConfig, "temperature", group=DATA)
    top_p: float = from_component(ChainConfig, "top_p", group=DATA)
    gen_batch_size: int = from_component(ChainConfig, "batch_size", group=DATA)
    gen_chunk: int = from_component(Collector, "chunk", group=DATA, at_most=MAX_QUERIES)
    generation_backend: str = key("hf", "hf (transformers generate, seeded per row, bit for bit) or vllm "
                                  "(a vLLM engine per rank; docs/vllm.md)", choices=GENERATION_BACKENDS,
                                  group=GEN)
    vllm_max_model_len: int = key(4096, "the engine's longest prompt plus reply, in tokens", group=GEN,
                                  at_least=16, at_most=MAX_TOKENS, fingerprint="ignored")
    vllm_kv_cache_gib: float = key(1.0, "CPU: the KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)", group=GEN,
                                   above=0, at_most=MAX_KV_CACHE_GIB, fingerprint="ignored")
    vllm_gpu_memory_utilization: float = key(0.5, "GPU: the engine's share of GPU memory; the trainer holds "
                                             "the rest", group=GEN, above=0, below=1, fingerprint="ignored")

    fitset_cache: Optional[str] = key(None, "the fit set: read from this file if it exists, else collected "
                                      "on-policy and saved there", metavar="PATH", group=DATA,
                                      fingerprint="content")
    fit_filter: str = key("drop_unclosed_think", "what is dropped before training: none, or messages whose "
                          "<think> block never closed", choices=FIT_FILTERS, group=OBJ)
    dedup_targets: int = key(3, "at most this many examples of a node may share one target text (0: off; "
                             "grpo keeps every message: a group's repeats are its samples)", group=OBJ,
                             at_least=0)
    dev_frac: float = key(0.0, "hold out this fraction of each seat's examples to track held-out NLL and "
                          "write <out>-best.safetensors (0: train on all); with recollect_every, of the "
                          "first collection's, kept for the whole run", group=HELD_OUT, at_least=0, below=1)
    dev_every: int = key(1, "measure the held-out NLL every N rounds (and after the last)", group=HELD_OUT,
                         at_least=1, at_most=MAX_ROUNDS, fingerprint="ignored")
    partition: str = key("seat", "seat: one node per adapted seat (the paper's setting); anchor: pool the "
                         "examples and split them over nodes by query", choices=PARTITION_MODES, group=ADMM)
    empty_nodes: str = key("error", "a node without examples: error (refuse the run) or prox (its f_i = 0: "
                           "it only follows the consensus)", choices=EMPTY_NODES, group=ADMM)
    n_partitions: int = key(0, "partition anchor: the number of nodes (0: one per adapted seat)", group=ADMM,
                            at_least=0, at_most=MAX_NODES)
    pooled: bool = key(False, "the centralized arm: every example on one node", group=ADMM)
    dry_run: bool = key(False, "build the fit sets and stop before any gradient step", group=DATA,
                        fingerprint="ignored")
    init_state: Optional[str] = key(None, "warm start: x^0 = z^0 = this saved adapter vector "
                                    "(an <out>-last.safetensors)", metavar="FILE", group=DATA,
                                    fingerprint="content")

    fit_mode: str = from_component(ObjectiveConfig, "fit_mode", group=OBJ)
    dpo_beta: float = from_component(ObjectiveConfig, "dpo_beta", group=OBJ)
    kl_beta: float = from_component(ObjectiveConfig, "kl_beta", group=OBJ)
    clip_eps: float = from_component(ObjectiveConfig, "clip_eps", group=OBJ)
    clip_eps_high: float = from_component(ObjectiveConfig, "clip_eps_high", group=OBJ)
    kl_ref: str = key("frozen", "the KL reference: frozen (the backbone, adapters off) or collect (the "
                      "policy that collected the examples: the --init_state adapter, else the backbone, for "
                      "the first collection; each seat's state at a re-collection)", choices=KL_REFS,
                      group=OBJ)
    no_role_balance: bool = key(False, "sample minibatches uniformly instead of balanced over a node's roles",
                                group=OBJ)
    target_span: str = from_component(ObjectiveConfig, "target_span", group=OBJ)
    max_target_tokens: int = from_component(ObjectiveConfig, "max_target_tokens", group=OBJ,
                                            at_most=MAX_TOKENS)
    max_prompt_tokens: int = from_component(ObjectiveConfig, "max_prompt_tokens", group=OBJ,
                                            at_most=MAX_TOKENS)
    no_grad_checkpointing: bool = key(False, "keep activations instead of recomputing them (faster, more "
                                      "memory)", group=OBJ)

    lora_rank: int = from_component(AdapterConfig, "lora_rank", group=ADAPTER)
    lora_alpha: float = from_component(AdapterConfig, "lora_alpha", group=ADAPTER)
    lora_layers_last: int = from_component(AdapterConfig, "lora_layers_last", group=ADAPTER)
    lora_targets: str = from_component(AdapterConfig, "lora_targets", group=ADAPTER)
    lora_basis_seed: Optional[int] = key(None, "seed of the frozen random basis A, the same on every rank "
                                         "(none: --seed)", group=ADAPTER)

    k_outer: int = key(20, "ADMM rounds T", group=ADMM, at_least=1, at_most=MAX_ROUNDS, fingerprint="ignored")
    local_steps: int = key(16, "local Adam steps L per x-step", group=ADMM, at_least=1,
                           at_most=MAX_LOCAL_STEPS)
    batch_size: int = key(8, "examples per local Adam step (a node with fewer repeats them)", group=ADMM,
                          at_least=1, at_most=MAX_BATCH_SIZE)
    shard_backbone: bool = key(False, "shard the frozen backbone over each seat's k ranks with FSDP2 "
                               "(W = k x seats): a rank holds 1/k of it; the numbers are the unsharded run's",
                               group=ADMM, fingerprint="ignored")
    micro_batches: int = key(1, "parts each local step's minibatch is computed in, in a fixed order: the "
                             "ranks of a seat (W = k x seats) share them, so it must be a multiple of k; "
                             "the numbers depend on it, never on W", group=ADMM, at_least=1,
                             at_most=MAX_BATCH_SIZE)
    eta: float = key(1e-3, "Adam learning rate (may change on resume=auto)", group=ADMM, above=0,
                     fingerprint="resumable")
    rho: float = from_component(ADMMConfig, "rho", group=ADMM)
    grad_clip: float = key(0.01, "clip each local step's gradient to this norm (may change on resume=auto)",
                           group=ADMM, above=0, fingerprint="resumable")
    consensus: str = key("ring", "how the z-step averages: coordinator (one all_reduce), ring (ring "
                         "all-reduce on send/recv), gossip (neighbour mixing on --topology; inexact), "
                         "decentralized (node-based decentralized ADMM on --topology: one neighbour "
                         "exchange per round, exact; rho sets c = rho / (2 x mean degree))",
                         choices=MODES, group=ADMM)
    topology: str = key("ring", "the graph of gossip and decentralized; grid is rows x cols, so a prime node "
                        "count > 3 is refused; chain is a path", choices=TOPOLOGIES, group=ADMM)
    gossip_steps: int = key(1, "gossip mixing steps tau per z-step (consensus gossip only)", group=ADMM,
                            at_least=1, at_most=MAX_GOSSIP_STEPS)
    compress: str = key("none",
                        "z-step payload: none (fp32), or a format of admm_dist/engine/codec.py (int8, "
                        "fp8 about 0.27x the bytes, int4 0.14x, bf16 0.5x: docs/engine.md) for each "
                        "node's change against a public copy (exact at convergence)", choices=COMPRESSIONS,
                        group=ADMM)
    local_only: bool = from_component(ADMMConfig, "local_only", group=ADMM)
    no_dual: bool = from_component(ADMMConfig, "no_dual", group=ADMM)
    rho_adapt: bool = from_component(ADMMConfig, "rho_adapt", group=ADMM)
    rho_mu: float = from_component(ADMMConfig, "rho_mu", group=ADMM)
    rho_tau: float = from_component(ADMMConfig, "rho_tau", group=ADMM)

    out: str = key("runs/admm", "the run's name: it writes <out>/, <out>-last.safetensors and <out>.ckpt/",
                   metavar="PATH", group=OUT, fingerprint="ignored")
    report_dir: str = key("results", "folder of the training report <name>-train.json", metavar="DIR",
                          group=OUT, fingerprint="ignored")
    quiet: bool = key(False, "no progress bars and no per-round lines", group=OUT, fingerprint="ignored")
    checkpoint_every: int = key(1, "write a checkpoint every N rounds", group=OUT, at_least=1,
                                at_most=MAX_ROUNDS, fingerprint="ignored")
    keep_checkpoints: int = key(3, "keep this run's last N checkpoints", group=OUT, at_least=1,
                                at_most=MAX_ROUNDS, fingerprint="ignored")
    resume: str = key("never", "never (a fresh run) or auto (continue from the last round every rank "
                      "completed)", choices=RESUME_MODES, group=OUT, fingerprint="ignored")
    overwrite: bool = key(False, "a fresh run may replace the run already in --out", group=OUT,
                          fingerprint="ignored")
    max_delta_w_rel: float = key(10.0, "a result whose ||dW|| / ||W|| is above this diverged and is refused",
                                 group=OUT, above=0, fingerprint="ignored")
    export_peft: bool = key(False, "also write <out>-last-peft/, a standard PEFT adapter folder", group=OUT,
                            fingerprint="ignored")
    report_to: str = from_component(TrackingConfig, "report_to", group=TRACK)
    tracking_dir: Optional[str] = from_component(TrackingConfig, "tracking_dir", group=TRACK)
    wandb_project: str = from_component(TrackingConfig, "wandb_project", group=TRACK)
    wandb_mode: str = from_component(TrackingConfig, "wandb_mode", group=TRACK)

    def __post_init__(self) -> None:
        # every key that sizes memory or work under its ceiling, named as given, before anything is built
        check_bounds(self)
        if not is_int(self.seed) or not 0 <= self.seed < 2 ** 63:   # before the basis seed it defaults
            raise UserError(f"seed={self.seed!r} is invalid: use an integer in [0, 2**63) (it also seeds the "
                            "LoRA basis unless lora_basis_seed is set)")
        # the components check their own fields (and say how to fix them)
        self.admm_config()
        self.adapter_config()
        self.objective_config()
        self.chain_config()
        self.tracking_config()
        check_device(self.device)   # auto, cpu, cuda or cuda:N: refused here, not once the run starts
        # the run's own choices (and the collector's), from each key's choice list
        for f in dataclasses.fields(self):
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if choices and value is not None and f.metadata.get("component") not in BUILT \
                    and value not in choices:
                raise UserError(f"{f.name}={value!r}: choose one of {', '.join(map(str, choices))}")
        if self.prefix_samples > 1 and self.credit != "per_role":
            raise UserError(f"prefix_samples={self.prefix_samples} picks the prefix per_role credit branches "
                            "from: use --credit per_role, or prefix_samples 1")
        if self.fit_mode == "grpo":   # on-policy by construction (docs/design.md, GRPO)
            if self.recollect_every != 1:
                raise UserError(f"fit_mode grpo trains on messages sampled under the state each seat "
                                f"deployed the round before, recollect_every={self.recollect_every} would "
                                "train on older ones: set recollect_every=1")
            if self.group < 2:
                raise UserError(f"fit_mode grpo weighs each message against the others of its group, and "
                                f"group={self.group} gives none: set group >= 2 (e.g. 8)")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise UserError(f"temperature={self.temperature}: collection samples; use a value > 0 (e.g. 0.8)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p={self.top_p}: use a value in (0, 1]")
        check_n_ops(self.task, self.n_ops)
        if self.anchor_pool is not None and self.anchor_pool < self.anchors:
            raise UserError(f"anchor_pool={self.anchor_pool} < anchors={self.anchors}: the pool must "
                            "hold at least the queries kept")
        self.pass_band()
        self.seat_backbones()
        check_mode(self.consensus, self.topology, self.gossip_steps)
        check_compress(self.compress)
        if self.local_only and self.compress != "none":
            raise UserError(f"compress={self.compress} has no effect under local_only (nothing is "
                            "exchanged): drop compress= or local_only")
        if self.micro_batches > self.batch_size:
            raise UserError(f"micro_batches={self.micro_batches} > batch_size={self.batch_size}: a part "
                            "needs at least one example; lower micro_batches or raise batch_size")
        if self.device_memory is not None:
            try:
                parse_size(self.device_memory)
            except ValueError as e:
                raise UserError(f"device_memory={e}") from None
        self._check_paths()
        self._check_out()
        if self.overwrite and self.resume == "auto":
            raise UserError("overwrite=true replaces the run in out=, resume=auto continues it: choose one")
        if self.pooled and self.partition == "anchor":
            raise UserError("pooled puts every example on one node: drop --partition anchor")

    def _check_paths(self) -> None:
        """A path key (PATH_KEYS) with a control character or a leading or trailing space is refused."""
        for name in PATH_KEYS:
            value = getattr(self, name)
            if not isinstance(value, str):
                continue
            bad = next((c for c in value if unicodedata.category(c) == "Cc"), None)
            if bad is not None:
                raise UserError(f"{name}={value!r} holds the control character {bad!r}: give the path "
                                "without it")
            if value != value.strip():
                raise UserError(f"{name}={value!r} starts or ends with a space: give the path without it")

    def _check_out(self) -> None:
        """``out`` names a run (``runs/x`` -> runs/x/, runs/x-last.safetensors, ...); a trailing
        slash is dropped."""
        out = str(self.out).rstrip("/")
        if not out or os.path.basename(out) in (".", ".."):
            raise UserError(f"out={self.out!r}: name the run, e.g. out=runs/ring (its files go to "
                            "runs/ring/, runs/ring-last.safetensors and runs/ring.ckpt/)")
        if not str(self.report_dir).strip():
            raise UserError("report_dir='': name a folder for the training report, e.g. report_dir=results")
        # Identity: two names of one folder are one run (locks, the "holds another run" check,
        # out_path in every record), so a linked out= is the folder it names (docs/outputs.md).
        object.__setattr__(self, "out", os.path.realpath(out))
        object.__setattr__(self, "report_dir", os.path.realpath(self.report_dir))

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
                               max_target_tokens=self.max_target_tokens, clip_eps=self.clip_eps,
                               clip_eps_high=self.clip_eps_high)

    def tracking_config(self) -> TrackingConfig:
        return TrackingConfig(report_to=self.report_to, tracking_dir=self.tracking_dir,
                              wandb_project=self.wandb_project, wandb_mode=self.wandb_mode)

    @property
    def basis_seed(self) -> int:
        return self.seed if self.lora_basis_seed is None else self.lora_basis_seed

    def adapted_seats(self):
        return adapted_seats(self.adapt_roles, self.n_agents)

    def collection_anchors(self, collection: int) -> int:
        """The queries kept by collection ``collection`` (0: the first)."""
        return self.anchors if collection == 0 or self.recollect_anchors is None else self.recollect_anchors

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

    @property
    def forward_rows(self) -> int:
        """Examples one forward takes at once outside the x-step too (reference log-probs, held-out
        NLL): a micro-batch's, so that ``micro_batches`` bounds every pass's activations."""
        return max(1, self.batch_size // self.micro_batches)

    def n_nodes(self) -> int:
        if self.pooled:
            return 1
        if self.partition == "anchor":
            return self.n_partitions or len(self.adapted_seats())
        return len(self.adapted_seats())

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def semantic(self, device: Optional[Any] = None) -> Dict[str, Any]:
        """Every setting that changes what is computed (its fingerprint role is "value", said at
        each key): what a checkpoint records of its run. With ``device`` (a torch.device),
        ``dtype`` is the one it resolves to there (``auto`` is float32 on CPU and bfloat16 on
        CUDA): a run written with ``auto`` resumes with ``float32`` on CPU, and is refused on
        CUDA, where the numbers would change."""
        values = {k: getattr(self, k) for k in keys_by_fingerprint(TrainConfig, "value")}
        if device is not None:
            from admm_dist.model.loading import backbone_dtype

            values["dtype"] = str(backbone_dtype(device, self.dtype)).removeprefix("torch.")
        return values

    def fingerprint(self, device: Optional[Any] = None) -> str:
        """Hash of :meth:`semantic` (the trainer adds the content of the fit set and init_state)."""
        return hashlib.sha256(json.dumps(self.semantic(device), sort_keys=True).encode()).hexdigest()[:16]


# Keys that change the numbers but may change when a run resumes (a step size that made the iterates
# non-finite is lowered and the run continues): every checkpoint records them, and a resumed run says
# which changed (docs/outputs.md).
RESUMABLE = keys_by_fingerprint(TrainConfig, "resumable")


def help_text() -> str:
    """Every key by group: its meaning, choices and default (the training command's ``--help``)."""
    return format_help(TrainConfig, GROUPS)
