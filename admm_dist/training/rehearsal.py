"""One rank of a GPU job rehearsed on this machine's CPU before the job runs: its memory by
category and the bytes it sends a round, at the job's real world size and shapes, in seconds.

:func:`rehearse` runs, as rank ``rank`` of ``world`` on torch's ``fake`` process group
(:func:`admm_dist.engine.dist.rehearsal_world`) and on fake tensors
(:class:`admm_dist.model.fake_run.FakeRun`), the trainer's own parts in the trainer's order:

1. the placement (:class:`~admm_dist.engine.placement.Placement`) and the communicator with
   the rank's mesh (:func:`~admm_dist.training.trainer.build_communicator`);
2. the backbone built from its ``config.json`` alone (no weights are read) in the job's dtype,
   whole, or with ``shard_backbone`` FSDP2's groups over the seat's ranks
   (:func:`~admm_dist.model.sharding.shard_groups`, as the sharded loader makes them);
3. the B-only LoRA (:class:`~admm_dist.model.adapter.BOnlyLoRA`, its reads of the backbone
   included) and gradient checkpointing as the job's device sets it;
4. the reference log-probs of a node's examples, where the objective needs them;
5. one local step of the x-step (:class:`~admm_dist.training.local_steps.LocalSteps`: the
   micro-batches, forward, backward, the proximal term, clipping, Adam's step) on ``batch_size``
   examples of the longest prompt and target the config keeps (``max_prompt_tokens``,
   ``max_target_tokens``): the worst minibatch;
6. one consensus round of the node vectors (its buffers, the codec's scratch, the metered bytes).

What is held is counted as it is made (:class:`~admm_dist.model.fake_run.FakeRun`); the
categories are read from the objects themselves (the backbone's shard, the adapter's vectors,
Adam's state) and from the phases (the reference pass's and the x-step's transient peaks, what
consensus keeps). Not rehearsed: rollouts (on-policy collection): their KV cache is given as a
figure from the shapes (HF generation) or the engine's setting (vLLM). See docs/placement.md.
"""
from __future__ import annotations

import dataclasses
import gc
import time
from typing import Dict, List, Optional, Tuple

import torch

from admm_dist.core.errors import UserError
from admm_dist.engine.admm import ADMMEngine
from admm_dist.engine.comm.meter import CONSENSUS
from admm_dist.engine.dist import rehearsal_world
from admm_dist.engine.placement import Placement
from admm_dist.engine.seat_group import SEAT
from admm_dist.model import batches as bt
from admm_dist.model.adapter import BOnlyLoRA
from admm_dist.model.fake_run import FakeRun
from admm_dist.model.loading import backbone_dtype
from admm_dist.model.sharding import held_bytes, run_root, shard_groups
from admm_dist.training import pipeline
from admm_dist.training.config import TrainConfig
from admm_dist.training.local_steps import LocalSteps, checkpoint_activations, reference_logps
from admm_dist.training.state import NodeState
from admm_dist.training.trainer import build_communicator

GiB = 1 << 30
# the categories of a rank's memory, in the order they are shown
CATEGORIES = ("backbone", "lora", "gradients", "adam", "reference", "admm_vectors", "consensus",
              "activations", "kv_cache")


@dataclasses.dataclass
class RankPlan:
    """What one rank of the job holds (bytes by :data:`CATEGORIES`, and the peak) and sends."""
    rank: int
    kind: str                     # "seat" (k = 1), "leader" or "follower" of a seat group
    world: int
    k: int                        # ranks per seat
    sharded: bool
    memory: Dict[str, int]
    peak: int                     # the most held at once, every phase counted
    sent: Dict[str, int]          # bytes this rank sends in one round, by what carries them
    seconds: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _shapes(cfg: TrainConfig):
    """The backbone's config (its shapes) from ``model_name``'s ``config.json``, a local folder or
    a hub id (only ``config.json`` is read)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model_name)
    except Exception as e:   # transformers raises OSError, ValueError, hub errors
        raise UserError(f"model_name={cfg.model_name}: no config.json to rehearse from "
                        f"({type(e).__name__}): give a folder holding the model's config.json "
                        f"(assets/shapes/ holds some)") from None


def _examples(cfg: TrainConfig, n: int) -> List[bt.Encoded]:
    """``n`` encoded examples of the longest prompt and target the config keeps."""
    p, t = cfg.max_prompt_tokens, cfg.max_target_tokens
    paired = cfg.objective_config().paired
    pair = dict(rejected_prompt_ids=[1] * p, rejected_ids=[1] * t, rejected_mask=[1] * t) if paired else {}
    return [bt.Encoded(example_index=i, role="r", prompt_ids=[1] * p, target_ids=[1] * t, target_mask=[1] * t,
                       **pair) for i in range(n)]


def _collects(cfg: TrainConfig) -> bool:
    """Does the job collect on-policy? A named fit set is taken to be there when the job runs (the
    rehearsal reads no data); without one, as the trainer decides."""
    return bool(cfg.recollect_every) or (not cfg.fitset_cache and pipeline.needs_collection(cfg))


def _kv_cache(cfg: TrainConfig, shapes, dtype: torch.dtype, device_memory: Optional[int]) -> int:
    """The rollout engine's KV cache where the run collects on-policy (0 otherwise): vLLM's share
    of the device, or HF generation's cache for one batch of chains at the longest context."""
    if not _collects(cfg):
        return 0
    if cfg.generation_backend == "vllm":
        return int(cfg.vllm_gpu_memory_utilization * device_memory) if device_memory else 0
    layers = shapes.num_hidden_layers
    heads = getattr(shapes, "num_key_value_heads", None) or shapes.num_attention_heads
    head_dim = getattr(shapes, "head_dim", None) or shapes.hidden_size // shapes.num_attention_heads
    context = cfg.text_mas_context_length or cfg.max_prompt_tokens   # None: the chain's whole context
    tokens = cfg.gen_batch_size * (context + cfg.max_new_tokens)
    return tokens * layers * 2 * heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def rehearse(cfg: TrainConfig, world: int, rank: int, *, per_node: Optional[int] = None,
             device: str = "cuda", device_memory: Optional[int] = None) -> RankPlan:
    """Rank ``rank`` of a job of ``world`` ranks on ``device`` (its type sets the dtype and the
    checkpointing, as in the job): what it holds and sends (the module docstring)."""
    t0 = time.monotonic()
    placement = Placement(cfg.n_nodes(), world)   # refuses a world it cannot place
    shapes = _shapes(cfg)
    target = torch.device(device)
    dtype = backbone_dtype(target, cfg.dtype)
    from transformers import AutoModelForCausalLM

    with rehearsal_world(rank, world, local_world_size=per_node, timeout_s=cfg.timeout_s) as ctx:
        comm, mesh = build_communicator(cfg, ctx, placement, _collects(cfg))
        sharded = cfg.shard_backbone and placement.k > 1
        with torch.device("meta"):   # shapes only: nothing is allocated, not even fake
            model = AutoModelForCausalLM.from_config(shapes, dtype=dtype)
        if sharded:
            shard_groups(model, mesh.shard)
        with FakeRun() as run:
            model.to_empty(device="cpu")          # each rank's shards only, with shard_backbone
            if sharded:
                run_root(model, "cpu")
            else:
                model.tie_weights()               # to_empty made the tied head a tensor of its own
            memory, peak, sent = round_memory(cfg, run, model, comm, mesh.seat, target)
        memory["kv_cache"] = _kv_cache(cfg, shapes, dtype, device_memory)
    seat = mesh.seat
    kind = "seat" if seat.k == 1 else ("leader" if seat.leads else "follower")
    return RankPlan(rank, kind, world, seat.k, sharded, memory, peak + memory["kv_cache"], sent,
                    round(time.monotonic() - t0, 1))


def round_memory(cfg: TrainConfig, run, model, comm, seat, target: torch.device
                 ) -> Tuple[Dict[str, int], int, Dict[str, int]]:
    """Steps 3-6 of the module docstring on ``model`` (the backbone, built), counted by ``run`` (a
    :class:`FakeRun`, or :class:`~admm_dist.model.fake_run.Counting` to measure a real run the
    same way): (bytes by category, peak, bytes sent a round). Python's cyclic collector is held
    for the count and run at each phase's start, so cyclic garbage is freed where a phase starts,
    never at a point of the count that a collection's timing picks."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _round_memory(cfg, run, model, comm, seat, target)
    finally:
        if collecting:
            gc.enable()


def _mark(run) -> int:
    """``run.mark()`` once the cyclic garbage made since the last mark is freed: the young
    generations only (cheap beside a full collection in a process holding many objects); with
    the collector held, nothing made in the count ages past them between marks."""
    gc.collect(1)
    return run.mark()


def _round_memory(cfg: TrainConfig, run, model, comm, seat, target: torch.device
                  ) -> Tuple[Dict[str, int], int, Dict[str, int]]:
    shapes, sharded = model.config, hasattr(model.get_decoder().layers[0], "unshard")
    model.config.use_cache = False
    model.eval()
    backbone = held_bytes(model)[0]
    _mark(run)
    adapter = BOnlyLoRA(model, cfg.adapter_config())   # its reads of the frozen weights included
    transient = {"build": run.peak - run.now}
    checkpoint_activations(adapter.model, cfg, target.type)
    pad = shapes.pad_token_id if shapes.pad_token_id is not None else 0
    nodes = list(comm.nodes)
    one_step = dataclasses.replace(cfg, local_steps=1)
    steps = LocalSteps(one_step, adapter.model, adapter, one_step.objective_config(), pad, seat)
    states, reference = {}, 0
    for node in nodes:
        encoded = _examples(cfg, cfg.batch_size)
        ocfg = cfg.objective_config()
        if ocfg.needs_reference or ocfg.needs_sampling:   # grpo's sampling log-probs count here too
            before = _mark(run)
            if ocfg.needs_reference:
                reference_logps(cfg, adapter, seat, encoded, None, pad)
            if ocfg.needs_sampling:
                reference_logps(cfg, adapter, seat, encoded, None, pad, sampling=True)
            transient["reference"] = run.peak - before
            reference += run.now - before
        opt = torch.optim.Adam([adapter.param], lr=cfg.eta, foreach=False)
        states[node] = NodeState(node, encoded, _Whole(len(encoded)), opt)
    held = _mark(run)
    engine = ADMMEngine(comm, cfg.admm_config(), [torch.zeros_like(adapter.flat) for _ in nodes], seat=seat)
    admm = run.now - held
    phase = {"x": 0}

    def xstep(node: int, x: torch.Tensor, centre: Optional[torch.Tensor], rho: float) -> float:
        before = _mark(run)
        value = steps.run(states[node], x, centre, rho)
        phase["x"] = max(phase["x"], run.peak - before)
        phase["after"] = _mark(run)
        return value

    engine.step(xstep, telemetry=False)   # the fake group's gathers hold no values to check
    round_peak = run.peak
    _mark(run)   # frees the round's cyclic garbage: what consensus keeps is what is held after it
    adam = sum(t.nbytes for st in states.values() for s in st.optimizer.state.values()
               for t in s.values() if isinstance(t, torch.Tensor))
    transient["x-step"] = phase["x"] - adam // len(nodes)   # Adam's state is made in the first step
    kept = run.now - phase["after"]
    transient["consensus"] = round_peak - phase["after"] - kept
    lora = held_bytes(adapter.model)[1]
    memory = {"backbone": backbone, "lora": lora, "gradients": adapter.flat_grad.nbytes, "adam": adam,
              "reference": reference, "admm_vectors": admm, "consensus": kept,
              "activations": max(transient.values())}
    resident = sum(memory.values()) - memory["activations"]
    sent = {"consensus": sum(comm.meter.total(node=n, phase=CONSENSUS).sent for n in nodes),
            "seat_group": sum(comm.meter.total(node=n, phase=SEAT).sent for n in nodes)}
    if sharded:   # FSDP2 gathers every layer's weights for the forward and again for the backward
        sent["fsdp_gathers"] = 2 * backbone * (seat.k - 1) * cfg.micro_batches // seat.k
    return memory, resident + memory["activations"], sent


class _Whole:
    """A sampler that hands the whole minibatch, once per step."""

    def __init__(self, n: int) -> None:
        self.n = n

    def next_batch(self) -> List[int]:
        return list(range(self.n))
