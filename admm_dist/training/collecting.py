"""A run's collections (Algorithm A1, steps 1 and 3): the chain rolled out on training queries,
on every rank a share, under the seat states the trainer hands over.

:class:`CollectionRunner` keeps what the collections of one run share: the ``agent_models``
backbones and, under ``generation_backend vllm``, this rank's engine, both made at the first
collection and kept for the later ones. :func:`record_collection` puts a collection's figures
in the report, the trackers and the log, and writes the first one to ``fitset_cache``.

What each seat deploys in the middle of a run, which a re-collection rolls it out under
(:func:`node_vectors`, :func:`seat_states`), and the state each node's messages were sampled under
(:func:`sampled_under`): the KL reference under ``kl_ref collect``, GRPO's sampling policy. Each
node's part is kept in every checkpoint
until the next collection, so a run resumed between two collections makes the last one again
under the same states. At the end of a run the same choice is written to files by
:mod:`admm_dist.training.outputs`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Sequence

import torch

from admm_dist.data import fitset as fs
from admm_dist.engine.comm import Communicator
from admm_dist.engine.dist import DistContext
from admm_dist.mas import vllm_backend    # vLLM itself loads only when an engine starts
from admm_dist.mas.collection import chain_runner, collect_fitset, gather_json, load_seat_models
from admm_dist.training import pipeline
from admm_dist.training.config import TrainConfig
from admm_dist.training.tracking import collection_scalars

if TYPE_CHECKING:
    from admm_dist.model.adapter import BOnlyLoRA
    from admm_dist.training.report import TrainReport
    from admm_dist.training.state import RunRecord
    from admm_dist.training.tracking import Tracker


class CollectionRunner:
    """One rank's collections of a run, on the trainer's backbone and adapter."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, comm: Communicator,
                 talk: Callable[[str], None]) -> None:
        self.cfg, self.ctx, self.comm, self.talk = cfg, ctx, comm, talk
        self.agent_models = None   # agent_models backbones, loaded at the first collection
        self._generator = None     # generation_backend vllm: this rank's engine, built at the first
                                   # collection

    def check_backend(self, collecting: bool) -> None:
        """Before any weights load: a run that will roll out under ``generation_backend vllm``
        needs vLLM installed (one line that says how, otherwise)."""
        if self.cfg.generation_backend == "vllm" and (collecting or self.cfg.recollect_every):
            vllm_backend.require_vllm()

    def fitset(self, collection: int, states: Dict[int, torch.Tensor], *, model: Any, tokenizer: Any,
               adapter: "BOnlyLoRA") -> fs.FitSet:
        """Roll out the chain on this collection's training queries, each adapted seat under its
        state in ``states`` (none: the backbone's, or the adapter as loaded)."""
        cfg, distributed = self.cfg, self.ctx.env.is_distributed
        was_training = model.training
        model.eval()
        try:
            if self.agent_models is None:
                self.agent_models = load_seat_models(cfg.seat_backbones(), self.ctx.device, cfg.dtype)
            runner = chain_runner(cfg, model, tokenizer, adapter=adapter, states=states,
                                  seat_models=self.agent_models, generator=self.generator(tokenizer, adapter))
            return collect_fitset(cfg, runner, collection=collection,
                                  init_sha=pipeline.file_fingerprint(cfg.init_state),
                                  rank=self.ctx.rank if distributed else 0,
                                  world=self.ctx.world_size if distributed else 1,   # a seat's k ranks too
                                  exchange=gather_json(self.comm, self.ctx.device, self.ctx.timeout)
                                  if distributed else None)
        finally:
            model.train(was_training)

    def generator(self, tokenizer: Any, adapter: "BOnlyLoRA"):
        """The rollout engine of ``generation_backend`` (None: transformers' generate)."""
        cfg = self.cfg
        if cfg.generation_backend == "hf" or self._generator is not None:
            return self._generator
        self.talk(f"starting a vLLM engine on every rank ({cfg.model_name}, LoRA rank {cfg.lora_rank})")
        self._generator = vllm_backend.VLLMBackend(
            cfg.model_name, tokenizer, adapter, seed=cfg.seed + self.ctx.rank, dtype=cfg.dtype,
            max_model_len=cfg.vllm_max_model_len, kv_cache_gib=cfg.vllm_kv_cache_gib,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization)
        return self._generator

    def close(self) -> None:
        """Stop the rollout engine, if one was started."""
        if self._generator is not None:
            try:
                self._generator.close()
            finally:
                self._generator = None


def record_collection(cfg: TrainConfig, f: fs.FitSet, collection: int, *, record: "RunRecord",
                      report: "TrainReport", tracker: "Tracker", talk: Callable[[str], None],
                      rank: int) -> None:
    """A collection's figures to the run's record, the trackers (at the round it ran after) and the
    log; rank 0 writes the first one to ``fitset_cache``."""
    stats = f.stats
    record.add_collection(stats, f.anchor_keys)
    tracker.log(collection * cfg.recollect_every, collection_scalars(stats))
    talk(f"collection {collection}: {stats['kept_queries']}/{stats['queries']} queries x {cfg.group} "
         f"({cfg.credit}), {len(f.examples)} examples, pass rate {stats['mean_pass_rate']:.3f}, "
         f"mixed groups {stats['mixed_group_rate']:.3f} ({stats['seconds']}s)")
    if cfg.fit_mode == "grpo":
        groups = stats["reward_groups"]
        talk(f"collection {collection}: {groups['zero_spread']} of {groups['groups']} seat groups had equal "
             "rewards (no advantage): their messages are not trained on")
    if collection == 0 and cfg.fitset_cache and rank == 0:
        fs.save_fitset(cfg.fitset_cache, f.examples, fit_mode="sft", settings=f.settings, stats=stats,
                       anchor_keys=f.anchor_keys)
        talk(f"wrote the collected fit set to {cfg.fitset_cache}")
    report.fitset_provenance = "collected"


# ----------------------------------------------------------------------------- what the seats deploy
def node_vectors(cfg: TrainConfig, engine, n_local: int) -> List[torch.Tensor]:
    """What each of this rank's nodes deploys now: its z_i (x_i under local_only)."""
    return [(engine.x[j] if cfg.local_only else engine.z[j]).detach().float().reshape(-1).clone()
            for j in range(n_local)]


def seat_states(cfg: TrainConfig, engine, vectors: Sequence[torch.Tensor]) -> Dict[int, torch.Tensor]:
    """{seat: the vector that seat deploys}, the same on every rank, from each local node's
    vector (:func:`node_vectors`, now or as a checkpoint kept it): the one consensus z where
    consensus is exact, else each seat its own node's, from every rank."""
    seats = cfg.adapted_seats()
    if engine.comm.exact and not cfg.local_only:
        z = vectors[0]
        return {s: z for s in seats}
    every = engine.every_node(vectors)
    return {s: every[0 if cfg.pooled else i].clone() for i, s in enumerate(seats)}


def sampled_under(cfg: TrainConfig, states: Dict[int, torch.Tensor],
                  nodes: Sequence[int]) -> Dict[int, torch.Tensor]:
    """After a re-collection: {node: the state its seat sampled its messages under}, the KL reference
    under ``kl_ref collect`` and the policy GRPO's ratio is taken against."""
    seats = cfg.adapted_seats()
    return {node: states[seats[0] if cfg.pooled else seats[node]] for node in nodes}
