"""The measured parts of the x-step benchmark (``python -m admm_dist.bench.xstep``).

It owns the benchmark's set-up (:class:`Sizes` and :func:`sizes_for` a shape of
:mod:`admm_dist.bench.shapes`, the WordLevel tokenizer, the random Qwen3, the random DPO
pairs, the :class:`~admm_dist.training.config.TrainConfig` and the Trainer whose data and
backbone are replaced) and the timed parts: the rows :func:`ours_row` (``Trainer.xstep``) and
:func:`trl_row` (TRL's DPOTrainer, with or without precomputed reference log-probs), which
:func:`admm_dist.bench.interleave.rotate` steps in rotation, and :func:`bench_overhead` (the
round overhead on gloo CPU ranks). What each part times is in :mod:`admm_dist.bench.xstep`'s
docstring, which also assembles, prints and writes them.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import random
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from admm_dist.bench.common import hush_future_warnings
from admm_dist.bench.interleave import Baton

PAD, UNK, EOS = "<|pad|>", "<|endoftext|>", "<|im_end|>"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROLE = "Planner"
PAIRS_SALT = 7919    # node i's synthetic pairs are drawn from seed + PAIRS_SALT * (i + 1)
DPO_BETA = 0.1
KL_BETA = 0.1
LR = 1e-3
GRAD_CLIP = 0.01
RHO = 0.03
TIMEOUT_S = 900.0


@dataclasses.dataclass(frozen=True)
class Sizes:
    shape: str = "tiny"          # a name of admm_dist.bench.shapes (the model dims below are its)
    vocab: int = 4096
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 1024
    tie: bool = True
    rope_theta: float = 10000.0
    max_positions: int = 2048
    batch: int = 8
    prompt_tokens: int = 64
    target_tokens: int = 64      # per completion, the EOS token included
    rank: int = 16
    steps: int = 20
    warmup: int = 3
    nprocs: int = 3
    local_steps: int = 16
    rounds: int = 6              # the first one is a warm-up


# A real shape: a batch of realistic length, fewer steps (each one is seconds on a GPU).
REAL_SHAPE_SIZES = dict(batch=4, prompt_tokens=512, target_tokens=256, steps=6, warmup=2)
# The micro shape (--quick): a smoke test, every count small.
QUICK_SIZES = dict(batch=2, prompt_tokens=8, target_tokens=8, rank=4, steps=3, warmup=1, local_steps=2,
                   rounds=3)


def sizes_for(shape_name: str) -> Sizes:
    """The benchmark's sizes on a shape of :mod:`admm_dist.bench.shapes`: ``tiny`` is the CPU
    default above, ``micro`` the smoke test (:data:`QUICK_SIZES`); a Qwen3 shape keeps its dims
    and takes :data:`REAL_SHAPE_SIZES`."""
    from admm_dist.bench import shapes

    shape = shapes.get(shape_name)
    dims = {k: getattr(shape, k) for k in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim",
                                           "intermediate", "tie", "rope_theta", "max_positions")}
    extra = {"tiny": {}, "micro": QUICK_SIZES}.get(shape_name, REAL_SHAPE_SIZES)
    return dataclasses.replace(Sizes(), shape=shape_name, **dims, **extra)


QUICK = sizes_for("micro")


# ----------------------------------------------------------------------------- model and data

def build_tokenizer(vocab: int):
    """A WordLevel tokenizer over ``vocab`` tokens: PAD, UNK, EOS, then ``w0``, ``w1``, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, UNK, EOS]
    table = {t: i for i, t in enumerate(specials)}
    for i in range(vocab - len(specials)):
        table[f"w{i}"] = len(table)
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, unk_token=UNK,
                                   eos_token=EOS, bos_token=None, padding_side="right")


def build_model(sz: Sizes, tok, device="cpu"):
    """A random-weight Qwen3 of ``sz``'s dims on ``device`` (bf16 on CUDA, fp32 on CPU), seed 0."""
    from admm_dist.bench.shapes import dtype_for
    from admm_dist.demo.tiny import random_qwen3

    model = random_qwen3(sz.vocab, hidden=sz.hidden, layers=sz.layers, heads=sz.heads,
                         kv_heads=sz.kv_heads, head_dim=sz.head_dim, intermediate=sz.intermediate,
                         tie=sz.tie, rope_theta=sz.rope_theta, max_positions=sz.max_positions, seed=0,
                         device=device,
                         dtype=dtype_for(device))
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.config.use_cache = False
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
    return model


def make_pairs(sz: Sizes, n: int, seed: int) -> List[Dict[str, str]]:
    """``n`` random pairs: prompt of ``prompt_tokens`` words; completions of
    ``target_tokens - 1`` words and EOS, each with a leading space."""
    rng = random.Random(seed)
    n_words = sz.vocab - 3

    def words(k: int) -> str:
        return " ".join(f"w{rng.randrange(n_words)}" for _ in range(k))

    return [{"prompt": words(sz.prompt_tokens),
             "chosen": " " + words(sz.target_tokens - 1) + EOS,
             "rejected": " " + words(sz.target_tokens - 1) + EOS} for _ in range(n)]


def to_examples(pairs: Sequence[Dict[str, str]]):
    from admm_dist.data.fitset import Example

    return [Example(seat=0, role=ROLE, anchor=f"a{i}", prompt=p["prompt"], target=p["chosen"],
                    rejected=p["rejected"]) for i, p in enumerate(pairs)]


def train_config(sz: Sizes, n_nodes: int, local_steps: int, device="cpu"):
    from admm_dist.training.config import TrainConfig

    cuda = torch.device(device).type == "cuda"
    return TrainConfig(
        task="bench", model_name="random-qwen3", device="cuda" if cuda else "cpu", seed=0, n_agents=n_nodes,
        backend="auto", timeout_s=TIMEOUT_S, fit_mode="dpo", dpo_beta=DPO_BETA, kl_beta=KL_BETA,
        lora_rank=sz.rank, lora_alpha=float(sz.rank), lora_layers_last=sz.layers,
        lora_targets="attn_mlp", local_steps=local_steps, batch_size=sz.batch, eta=LR, rho=RHO,
        grad_clip=GRAD_CLIP, consensus="ring", topology="ring", quiet=True,
        # as TRL's gradient_checkpointing: on a GPU on (recomputation), on the CPU off
        no_grad_checkpointing=not cuda,
        max_prompt_tokens=max(8192, sz.prompt_tokens), max_target_tokens=max(4096, sz.target_tokens))


def bench_trainer_class():
    from admm_dist.training.trainer import Trainer

    class BenchTrainer(Trainer):
        """The real Trainer; only the fit-set file and the backbone folder are replaced."""

        def __init__(self, cfg, ctx, sz: Sizes, shards: Dict[int, List[Any]]):
            super().__init__(cfg, ctx, log=lambda m: None)
            self._sz, self._shards = sz, shards

        def needs_collection(self):
            return False

        def check_outputs(self):
            """The benchmark writes no outputs: whatever is in the default out is not its concern."""

        def read_fitset(self):
            return None

        def shard(self, f=None, hold_out=True):
            return {n: self._shards[n] for n in self.nodes}, []

        def load_backbone(self):
            tok = build_tokenizer(self._sz.vocab)
            return build_model(self._sz, tok, self.ctx.device), tok

    return BenchTrainer


def single_ctx(device="cpu"):
    from admm_dist.engine.dist import DistContext
    from admm_dist.engine.env import DistEnv

    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    return DistContext(env=DistEnv(), device=device, backend=None,
                       timeout=datetime.timedelta(seconds=TIMEOUT_S))


def sync(device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- (a) ours

def ours_row(sz: Sizes, pairs: Sequence[Dict[str, str]], device="cpu") -> Callable[[Baton], Dict[str, Any]]:
    """The loop of ``Trainer.xstep`` as a row of :func:`admm_dist.bench.interleave.rotate`:
    one xstep call of ``warmup + steps`` local steps, the turn handed back by an optimizer
    step post-hook (see the module docstring of :mod:`admm_dist.bench.xstep`)."""
    def fn(baton: Baton) -> Dict[str, Any]:
        cfg = train_config(sz, 1, sz.warmup + sz.steps, device)
        trainer = bench_trainer_class()(cfg, single_ctx(device), sz, {0: to_examples(pairs)})
        trainer.setup()
        sync(device)
        t0 = time.perf_counter()
        trainer.build_nodes()
        sync(device)
        precompute = time.perf_counter() - t0
        node = trainer.nodes[0]
        handle = trainer.state[node].optimizer.register_step_post_hook(lambda *_: baton.step_done())
        eng = trainer.engine
        centre = eng.centre(0)
        baton.ready()
        try:
            f = trainer.xstep(node, eng.x[0], centre, eng.rho)
        finally:
            handle.remove()
        return {"ours_precompute_s": precompute, "ours_mean_f": f, "numel_b": trainer.adapter.numel,
                "threads": torch.get_num_threads(),
                "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False))}
    return fn


# ----------------------------------------------------------------------------- (b, c) TRL

def trl_version() -> Optional[str]:
    try:
        import trl
    except Exception:  # ImportError, or a broken install
        return None
    return str(getattr(trl, "__version__", "unknown"))


def trl_row(sz: Sizes, pairs: Sequence[Dict[str, str]], precompute: bool,
            device="cpu") -> Callable[[Baton], Dict[str, Any]]:
    """TRL's DPOTrainer as a row of :func:`admm_dist.bench.interleave.rotate`: ``train()``
    hands the turn back at every ``on_step_end`` (see :mod:`admm_dist.bench.xstep`)."""
    def fn(baton: Baton) -> Dict[str, Any]:
        return _trl(sz, pairs, precompute, torch.device(device), baton)
    return fn


def _trl(sz: Sizes, pairs, precompute: bool, device, baton: Baton) -> Dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PrinterCallback, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    stamps: Dict[str, Any] = {"begin": [], "end": [], "precompute_s": 0.0}
    cuda = device.type == "cuda"

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            stamps["threads"] = torch.get_num_threads()
            baton.ready()

        def on_step_begin(self, args, state, control, **kw):
            stamps["begin"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            sync(device)
            stamps["end"].append(time.perf_counter())
            baton.step_done()

    class TimedDPOTrainer(DPOTrainer):
        def _precompute_ref_logps(self, *a, **kw):
            t = time.perf_counter()
            try:
                return super()._precompute_ref_logps(*a, **kw)
            finally:
                sync(device)
                stamps["precompute_s"] += time.perf_counter() - t

    tok = build_tokenizer(sz.vocab)
    model = build_model(sz, tok, device)
    data = Dataset.from_dict({k: [p[k] for p in pairs] for k in ("prompt", "chosen", "rejected")})
    n_steps = sz.warmup + sz.steps
    with tempfile.TemporaryDirectory(prefix="admm-bench-trl-") as out:
        args = DPOConfig(
            output_dir=out, per_device_train_batch_size=sz.batch, max_steps=n_steps,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=GRAD_CLIP, beta=DPO_BETA, bf16=cuda, fp16=False,
            gradient_checkpointing=cuda, gradient_checkpointing_kwargs={"use_reentrant": False},
            use_cpu=not cuda, precompute_ref_log_probs=precompute,
            logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none",
            disable_tqdm=True, dataloader_num_workers=0, seed=0, max_length=None)
        peft_config = LoraConfig(r=sz.rank, lora_alpha=sz.rank, target_modules=list(PROJECTIONS),
                                 lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        t0 = time.perf_counter()
        trainer = TimedDPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                                  peft_config=peft_config, callbacks=[Timer()])
        build_s = time.perf_counter() - t0
        trainer.remove_callback(PrinterCallback)  # it prints the final metrics dict
        frozen = 0
        for name, p in trainer.model.named_parameters():
            if "lora_A" in name:
                p.requires_grad_(False)
                frozen += 1
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        row = trainer.train_dataset[0]
        lengths = [len(row["prompt_ids"]), len(row["chosen_ids"]), len(row["rejected_ids"])]
        torch.set_num_threads(1)  # in case anything changed it
        trainer.train()
    if len(stamps["end"]) != n_steps:
        raise RuntimeError(f"TRL made {len(stamps['end'])} steps, expected {n_steps}")
    inner = [e - b for b, e in zip(stamps["begin"], stamps["end"])]
    return {"inner_step_times_s": inner[sz.warmup:], "inner_median_s": statistics.median(inner[sz.warmup:]),
            "precompute_ref_s": stamps["precompute_s"], "construct_s": build_s, "lora_a_frozen": frozen,
            "trainable_params": trainable, "token_lengths_prompt_chosen_rejected": lengths,
            "threads": stamps.get("threads"),
            "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False))}


# ----------------------------------------------------------------------------- (d) overhead

def _overhead_rank(ctx, sz: Sizes, seed: int) -> Dict[str, Any]:
    hush_future_warnings()
    torch.set_num_threads(1)
    n = ctx.world_size
    cfg = train_config(sz, n, sz.local_steps)
    n_pairs = sz.batch * sz.local_steps * sz.rounds
    shards = {node: to_examples(make_pairs(sz, n_pairs, seed + PAIRS_SALT * (node + 1)))
              for node in range(n)}
    trainer = bench_trainer_class()(cfg, ctx, sz, shards)
    trainer.setup()
    trainer.build_nodes()
    trainer.comm.barrier()
    walls, records = [], []
    for _ in range(sz.rounds):
        t0 = time.perf_counter()
        rec = trainer.engine.step(trainer.xstep)
        walls.append(time.perf_counter() - t0)
        records.append(rec.as_dict())
    return {"rank": ctx.rank, "step_wall_s": walls, "records": records,
            "threads": torch.get_num_threads(), "comm": type(trainer.comm).__name__}


def bench_overhead(sz: Sizes, seed: int) -> Dict[str, Any]:
    from admm_dist.bench.launcher import launch_cpu

    if sz.rounds < 2:
        raise ValueError("the overhead part needs at least 2 rounds (one warm-up)")
    t0 = time.perf_counter()
    res = launch_cpu(_overhead_rank, sz.nprocs, sz, seed, timeout_s=TIMEOUT_S, threads=1)
    wall = time.perf_counter() - t0
    ranks = [res[r] for r in range(sz.nprocs)]
    records = ranks[0]["records"]
    rounds = []
    for k, rec in enumerate(records):
        tot = [x + z + o for x, z, o in zip(rec["sec_x"], rec["sec_z"], rec["sec_other"])]
        w, x = max(tot), max(rec["sec_x"])
        w_step = max(rk["step_wall_s"][k] for rk in ranks)
        rounds.append({"round": rec["round"], "wall_s": w, "step_wall_s": w_step, "x_s": x,
                       "sec_x": rec["sec_x"], "sec_z": rec["sec_z"], "sec_other": rec["sec_other"],
                       "share": (w - x) / w, "share_step_wall": (w_step - x) / w_step})
    timed = rounds[1:]
    cores = os.cpu_count() or 1
    x_per_step = [r["x_s"] / sz.local_steps for r in timed]
    return {"overhead_share": statistics.median(r["share"] for r in timed),
            "overhead_share_step_wall": statistics.median(r["share_step_wall"] for r in timed),
            "overhead_rounds": rounds, "overhead_nprocs": sz.nprocs,
            "overhead_local_steps": sz.local_steps, "overhead_warmup_rounds": 1,
            "overhead_x_s_per_step": statistics.median(x_per_step),
            "overhead_comm": ranks[0]["comm"], "overhead_launch_wall_s": wall,
            "oversubscribed": sz.nprocs > cores,
            "overhead_threads_per_rank": ranks[0]["threads"]}
