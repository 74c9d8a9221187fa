"""x-step benchmark: one local DPO Adam step of this project vs TRL's DPOTrainer, and the round overhead.

Run::

    python -m admm_dist.bench.xstep [--json PATH] [--steps 20] [--warmup 3] [--rounds 6]
                                    [--no-trl] [--quick]

Set-up, the same for every row. A randomly initialised ``Qwen3ForCausalLM`` (hidden 256,
4 layers, 4 heads, intermediate 1024, vocab 4096, tied embeddings, fp32, seed 0; built by
:func:`admm_dist.testing.tiny.tiny_qwen3`, nothing downloaded) and a WordLevel tokenizer over 4096
tokens (3 specials and synthetic words ``w0 w1 ...``, whitespace pre-tokenizer) in a
``PreTrainedTokenizerFast``. The data are ``batch * (warmup + steps)`` random DPO pairs: a
64-token prompt and a chosen and a rejected completion of 64 tokens each (63 words and the
EOS token; a completion starts with a space and ends with the EOS string, so that TRL's
tokenization of prompt + completion gives exactly these tokens and adds no second EOS). Each
run uses a fresh model, one torch thread (``torch.set_num_threads(1)``), batch 8 pairs, a
rank-16 LoRA (alpha 16) on all seven projections (q, k, v, o, gate, up, down) of all 4 layers
with lora_A frozen, DPO beta 0.1, learning rate 1e-3, gradient-norm clip 0.01, constant rate.

Rows (seconds per optimizer step):

- ``ours_s``: this project's x-step. A :class:`admm_dist.training.trainer.Trainer` (single-process
  backend, ``local_steps = warmup + steps``) whose only replaced methods are ``load_data``
  (returns the pairs above) and ``load_backbone`` (returns the tiny model and tokenizer);
  ``setup()`` and ``build_nodes()`` run unchanged (BOnlyLoRA, encode, the reference
  log-probs computed once by ``precompute_reference``, the role-balanced sampler, Adam on
  ``adapter.param``), with ``no_grad_checkpointing`` set as in the CPU configs (no
  activation recomputation, like TRL's ``gradient_checkpointing=False`` below). One call
  of the real ``Trainer.xstep`` with a proximal anchor (rho 0.03, KL term kl_beta 0.1) runs
  all the steps; an optimizer step post-hook stamps the end of every step, and a step's
  time is the gap between consecutive stamps (the first step starts at the call):
  sampling, ``collate``, ``loss`` (one forward of chosen + rejected), backward, proximal
  gradient, clip and Adam. ``ours_precompute_s`` is the time of
  ``build_nodes()`` (tokenization and the reference pass over every pair), once.
- ``trl_s``: TRL's ``DPOTrainer`` with its defaults for the step (the reference log-probs
  computed every step with the adapter disabled), given the plain model and a peft
  ``LoraConfig``; ``bf16=False``, ``gradient_checkpointing=False``, ``use_cpu=True``,
  ``max_steps = warmup + steps``, no logging, saving or evaluation, its default optimizer
  (AdamW, weight decay 0). lora_A is frozen on ``trainer.model`` after the trainer is built
  and before ``train()``, so TRL trains exactly as many B entries as ``numel_b``.
- ``trl_precompute_s``: the same with ``precompute_ref_log_probs=True``. TRL computes the
  reference log-probs of the whole data set once, inside the trainer's constructor; that
  call (``_precompute_ref_logps``) is timed by itself and reported as
  ``trl_precompute_ref_s``, never as a step.

  For TRL a ``TrainerCallback`` stamps ``on_train_begin`` and every ``on_step_end``; a
  step's time is the gap between consecutive stamps, which covers what our gap covers
  (fetching and collating the batch, forward(s), backward, clip, optimizer, scheduler,
  zero_grad). The time from ``on_step_begin`` to ``on_step_end`` (no batch fetch) is also
  kept as ``trl_inner_s`` / ``trl_precompute_inner_s``.

For every row the first ``warmup`` steps are dropped and the reported value is the median
of the next ``steps`` step times; every step time is in the JSON. ``trl_over_ours`` and
``trl_precompute_over_ours`` divide the TRL medians by ``ours_s``. If ``trl`` cannot be
imported (it is not a dependency of this package: ``pip install trl``), the TRL rows are
skipped with a one-line message and their fields are null.

``overhead_share``: the share of an ADMM round's wall time spent outside the x-steps, with 3
gloo CPU ranks (:func:`admm_dist.engine.launcher.launch_cpu`, one torch thread each, consensus
``ring``), each rank a real Trainer built as above (its own pairs, ``local_steps`` 16) and
running ``trainer.engine.step(trainer.xstep)``. Per round, from the engine's
:class:`~admm_dist.engine.admm.RoundRecord` (gathered from every rank): wall = max over ranks of
``sec_x + sec_z + sec_other``, x = max over ranks of ``sec_x``, share = (wall - x) / wall;
the first round is a warm-up, ``overhead_share`` is the median over the other rounds.
``overhead_share_step_wall`` is the same with wall = max over ranks of the time of the whole
``engine.step`` call (it also covers the telemetry gather). The 3 ranks share the machine's
cores (2 on the reference machine: oversubscribed, reported as ``oversubscribed``), so their
x-steps are slower than ``ours_s`` and a fast rank waits for the slowest one inside the
z-step.

The four parts run one after the other in this process (the ranks in spawned processes);
the load average before and after and the cores used by other processes are reported.
``--quick`` shrinks everything (hidden 64, 2 layers, vocab 512, batch 2, 8-token texts,
rank 4, 3 steps after 1 warm-up, 2 local steps, 1 + 2 rounds) for a smoke test.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch

PAD, UNK, EOS = "<|pad|>", "<|endoftext|>", "<|im_end|>"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROLE = "Planner"
DPO_BETA = 0.1
KL_BETA = 0.1
LR = 1e-3
GRAD_CLIP = 0.01
RHO = 0.03
TIMEOUT_S = 900.0


def _hush() -> None:
    """Keep the libraries' deprecation chatter (e.g. transformers' is_gradient_checkpointing,
    read by PEFT) out of the table."""
    warnings.filterwarnings("ignore", category=FutureWarning)


@dataclasses.dataclass(frozen=True)
class Sizes:
    vocab: int = 4096
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    batch: int = 8
    prompt_tokens: int = 64
    target_tokens: int = 64      # per completion, the EOS token included
    rank: int = 16
    steps: int = 20
    warmup: int = 3
    nprocs: int = 3
    local_steps: int = 16
    rounds: int = 6              # the first one is a warm-up


QUICK = Sizes(vocab=512, hidden=64, layers=2, heads=2, batch=2, prompt_tokens=8, target_tokens=8,
              rank=4, steps=3, warmup=1, local_steps=2, rounds=3)


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


def build_model(sz: Sizes, tok):
    from admm_dist.testing.tiny import tiny_qwen3

    model = tiny_qwen3(sz.vocab, hidden=sz.hidden, layers=sz.layers, heads=sz.heads, seed=0)
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


def _train_config(sz: Sizes, n_nodes: int, local_steps: int):
    from admm_dist.training.config import TrainConfig

    return TrainConfig(
        task="bench", model_name="tiny-random-qwen3", device="cpu", seed=0, n_agents=n_nodes,
        backend="auto", timeout_s=TIMEOUT_S, fit_mode="dpo", dpo_beta=DPO_BETA, kl_beta=KL_BETA,
        lora_rank=sz.rank, lora_alpha=float(sz.rank), lora_layers_last=sz.layers,
        lora_targets="attn_mlp", local_steps=local_steps, batch_size=sz.batch, eta=LR, rho=RHO,
        grad_clip=GRAD_CLIP, consensus="ring", topology="ring", quiet=True,
        no_grad_checkpointing=True,  # as TRL's gradient_checkpointing=False: no recomputation
        max_prompt_tokens=max(8192, sz.prompt_tokens), max_target_tokens=max(4096, sz.target_tokens))


def _bench_trainer_class():
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

        def load_data(self, f=None):
            return {n: self._shards[n] for n in self.nodes}, []

        def load_backbone(self):
            tok = build_tokenizer(self._sz.vocab)
            return build_model(self._sz, tok), tok

    return BenchTrainer


def _single_ctx():
    from admm_dist.engine.dist import DistContext, DistEnv

    return DistContext(env=DistEnv(), device=torch.device("cpu"), backend=None,
                       timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _tail(times: Sequence[float], warmup: int) -> List[float]:
    return list(times[warmup:])


# ----------------------------------------------------------------------------- (a) ours

def bench_ours(sz: Sizes, pairs: Sequence[Dict[str, str]]) -> Dict[str, Any]:
    """Median seconds per local Adam step of ``Trainer.xstep`` (see the module docstring)."""
    cfg = _train_config(sz, 1, sz.warmup + sz.steps)
    trainer = _bench_trainer_class()(cfg, _single_ctx(), sz, {0: to_examples(pairs)})
    trainer.setup()
    t0 = time.perf_counter()
    trainer.build_nodes()
    precompute = time.perf_counter() - t0
    node = trainer.nodes[0]
    stamps: List[float] = []
    handle = trainer.state[node].optimizer.register_step_post_hook(
        lambda *_: stamps.append(time.perf_counter()))
    eng = trainer.engine
    anchor = eng.anchor(0)
    start = time.perf_counter()
    f = trainer.xstep(node, eng.x[0], anchor, eng.rho)
    handle.remove()
    if len(stamps) != cfg.local_steps:
        raise RuntimeError(f"xstep made {len(stamps)} optimizer steps, expected {cfg.local_steps}"
                           f" (f={f})")
    steps = [b - a for a, b in zip([start] + stamps[:-1], stamps)]
    timed = _tail(steps, sz.warmup)
    return {"ours_s": statistics.median(timed), "ours_step_times_s": timed,
            "ours_warmup_times_s": steps[:sz.warmup], "ours_precompute_s": precompute,
            "ours_mean_f": f, "numel_b": trainer.adapter.numel,
            "threads": torch.get_num_threads()}


# ----------------------------------------------------------------------------- (b, c) TRL

def trl_version() -> Optional[str]:
    try:
        import trl
    except Exception:  # ImportError, or a broken install
        return None
    return str(getattr(trl, "__version__", "unknown"))


def bench_trl(sz: Sizes, pairs: Sequence[Dict[str, str]], precompute: bool) -> Dict[str, Any]:
    """Median seconds per step of TRL's DPOTrainer (see the module docstring)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PrinterCallback, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    stamps: Dict[str, Any] = {"begin": [], "end": [], "train_begin": None, "precompute_s": 0.0}

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            stamps["train_begin"] = time.perf_counter()
            stamps["threads"] = torch.get_num_threads()

        def on_step_begin(self, args, state, control, **kw):
            stamps["begin"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            stamps["end"].append(time.perf_counter())

    class TimedDPOTrainer(DPOTrainer):
        def _precompute_ref_logps(self, *a, **kw):
            t = time.perf_counter()
            try:
                return super()._precompute_ref_logps(*a, **kw)
            finally:
                stamps["precompute_s"] += time.perf_counter() - t

    tok = build_tokenizer(sz.vocab)
    model = build_model(sz, tok)
    data = Dataset.from_dict({k: [p[k] for p in pairs] for k in ("prompt", "chosen", "rejected")})
    n_steps = sz.warmup + sz.steps
    with tempfile.TemporaryDirectory(prefix="admm-bench-trl-") as out:
        args = DPOConfig(
            output_dir=out, per_device_train_batch_size=sz.batch, max_steps=n_steps,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=GRAD_CLIP, beta=DPO_BETA, bf16=False, fp16=False,
            gradient_checkpointing=False, use_cpu=True, precompute_ref_log_probs=precompute,
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
    if len(stamps["end"]) != n_steps or stamps["train_begin"] is None:
        raise RuntimeError(f"TRL made {len(stamps['end'])} steps, expected {n_steps}")
    ends = stamps["end"]
    steps = [b - a for a, b in zip([stamps["train_begin"]] + ends[:-1], ends)]
    inner = [e - b for b, e in zip(stamps["begin"], ends)]
    timed, timed_inner = _tail(steps, sz.warmup), _tail(inner, sz.warmup)
    return {"median_s": statistics.median(timed), "step_times_s": timed,
            "warmup_times_s": steps[:sz.warmup], "inner_median_s": statistics.median(timed_inner),
            "inner_step_times_s": timed_inner, "precompute_ref_s": stamps["precompute_s"],
            "build_s": build_s, "lora_a_frozen": frozen, "trainable_params": trainable,
            "token_lengths_prompt_chosen_rejected": lengths, "threads": stamps.get("threads")}


# ----------------------------------------------------------------------------- (d) overhead

def _overhead_rank(ctx, sz: Sizes, seed: int) -> Dict[str, Any]:
    _hush()
    torch.set_num_threads(1)
    n = ctx.world_size
    cfg = _train_config(sz, n, sz.local_steps)
    n_pairs = sz.batch * sz.local_steps * sz.rounds
    shards = {node: to_examples(make_pairs(sz, n_pairs, seed + 7919 * (node + 1)))
              for node in range(n)}
    trainer = _bench_trainer_class()(cfg, ctx, sz, shards)
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
    from admm_dist.engine.launcher import launch_cpu

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


# ----------------------------------------------------------------------------- run

def run(sz: Sizes, *, with_trl: bool = True, seed: int = 0, log=print) -> Dict[str, Any]:
    from admm_dist.bench.comm import _CpuClock, _loadavg, _other_cores

    torch.set_num_threads(1)
    load0 = _loadavg()
    busy0, own0, wall0 = _CpuClock.machine_busy_s(), _CpuClock.own_s(), time.perf_counter()
    pairs = make_pairs(sz, sz.batch * (sz.warmup + sz.steps), seed)
    out: Dict[str, Any] = {"sizes": dataclasses.asdict(sz), "torch": torch.__version__,
                           "python": platform.python_version(), "cpu_cores": os.cpu_count()}
    try:
        import transformers
        import peft
        out.update(transformers=transformers.__version__, peft=peft.__version__)
    except ImportError:  # pragma: no cover - both are dependencies
        pass

    log(f"# (a) ours: Trainer.xstep, {sz.warmup}+{sz.steps} steps ...")
    out.update(bench_ours(sz, pairs))

    version = trl_version() if with_trl else None
    out["trl"] = version
    trl_fields = ("trl_s", "trl_precompute_s", "trl_over_ours", "trl_precompute_over_ours",
                  "trl_precompute_ref_s", "trl_inner_s", "trl_precompute_inner_s")
    out.update({k: None for k in trl_fields})
    if not with_trl:
        log("# TRL rows skipped (--no-trl)")
        out["trl_skipped"] = "--no-trl"
    elif version is None:
        log("# trl is not importable: TRL rows skipped (pip install trl to compare with TRL)")
        out["trl_skipped"] = "trl not importable"
    else:
        for key, pre in (("trl", False), ("trl_precompute", True)):
            log(f"# ({'c' if pre else 'b'}) TRL {version} DPOTrainer"
                f"{' precompute_ref_log_probs=True' if pre else ''} ...")
            with _quiet_libraries():
                r = bench_trl(sz, pairs, pre)
            out[f"{key}_s"] = r["median_s"]
            out[f"{key}_over_ours"] = r["median_s"] / out["ours_s"]
            out[f"{key}_inner_s"] = r["inner_median_s"]
            out[f"{key}_step_times_s"] = r["step_times_s"]
            out[f"{key}_warmup_times_s"] = r["warmup_times_s"]
            out[f"{key}_inner_step_times_s"] = r["inner_step_times_s"]
            out[f"{key}_build_s"] = r["build_s"]
            out[f"{key}_lora_a_frozen"] = r["lora_a_frozen"]
            out[f"{key}_trainable_params"] = r["trainable_params"]
            out[f"{key}_token_lengths"] = r["token_lengths_prompt_chosen_rejected"]
            out[f"{key}_threads"] = r["threads"]
            if pre:
                out["trl_precompute_ref_s"] = r["precompute_ref_s"]
        torch.set_num_threads(1)

    log(f"# (d) overhead: {sz.nprocs} gloo ranks, local_steps {sz.local_steps}, "
        f"1+{sz.rounds - 1} rounds ...")
    t, b, o = time.perf_counter(), _CpuClock.machine_busy_s(), _CpuClock.own_s()
    out.update(bench_overhead(sz, seed + 1))
    out["overhead_other_processes_cores"] = _other_cores(
        b, _CpuClock.machine_busy_s(), _CpuClock.own_s() - o, time.perf_counter() - t)

    wall = time.perf_counter() - wall0
    out.update(wall_s=wall, loadavg_1min_before=load0, loadavg_1min_after=_loadavg(),
               other_processes_cores=_other_cores(busy0, _CpuClock.machine_busy_s(),
                                                  _CpuClock.own_s() - own0, wall))
    return out


@contextlib.contextmanager
def _quiet_libraries():
    """Keep transformers/datasets progress bars and info logs out of the table."""
    saved = {k: os.environ.get(k) for k in ("TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS")}
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        v_tf = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        v_tf = None
    try:
        yield
    finally:
        if v_tf is not None:
            transformers.logging.set_verbosity(v_tf)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _f(x: Optional[float], fmt: str) -> str:
    return "skipped" if x is None else format(x, fmt)


def format_table(r: Dict[str, Any]) -> str:
    sz = r["sizes"]
    lines = [f"{'row':<44} {'s/step':>8} {'/ ours':>7}", "-" * 61]
    lines.append(f"{'ours_s  (Trainer.xstep, ref precomputed)':<44} {r['ours_s']:>8.4f} {1.0:>7.2f}")
    lines.append(f"{'trl_s  (DPOTrainer default)':<44} {_f(r['trl_s'], '8.4f'):>8} "
                 f"{_f(r['trl_over_ours'], '7.2f'):>7}")
    lines.append(f"{'trl_precompute_s  (precompute_ref_log_probs)':<44} "
                 f"{_f(r['trl_precompute_s'], '8.4f'):>8} {_f(r['trl_precompute_over_ours'], '7.2f'):>7}")
    lines.append("-" * 61)
    n_pairs = sz["batch"] * (sz["warmup"] + sz["steps"])
    lines.append(f"one-off reference pass: ours {r['ours_precompute_s']:.2f} s, TRL "
                 f"{_f(r['trl_precompute_ref_s'], '.2f')} s ({n_pairs} pairs)")
    if r["trl_s"] is not None:
        lines.append(f"TRL on_step_begin->on_step_end (no batch fetch): default "
                     f"{r['trl_inner_s']:.4f} s, precompute {r['trl_precompute_inner_s']:.4f} s")
    lines.append(f"overhead_share {r['overhead_share']:.4f} (RoundRecord), "
                 f"{r['overhead_share_step_wall']:.4f} (whole engine.step); {r['overhead_nprocs']} "
                 f"ranks on {r['cpu_cores']} cores{' (oversubscribed)' if r['oversubscribed'] else ''}, "
                 f"local_steps {r['overhead_local_steps']}, x-step {r['overhead_x_s_per_step']:.4f} "
                 f"s/step there, median of {len(r['overhead_rounds']) - 1} rounds after 1 warm-up")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m admm_dist.bench.xstep",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="write the results here (a JSON dict), atomically")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per row after the warm-up (default 20; --quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; --quick 1)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="ADMM rounds of the overhead part, the first a warm-up (default 6; --quick 3)")
    ap.add_argument("--no-trl", action="store_true", help="skip the TRL rows")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, few steps")
    args = ap.parse_args(argv)
    sz = QUICK if args.quick else Sizes()
    over = {k: v for k, v in (("steps", args.steps), ("warmup", args.warmup),
                              ("rounds", args.rounds)) if v is not None}
    sz = dataclasses.replace(sz, **over)
    if sz.steps < 1 or sz.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if sz.rounds < 2:
        ap.error("--rounds must be >= 2 (the first is a warm-up)")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    _hush()
    print(f"# x-step benchmark: Qwen3 hidden {sz.hidden}, {sz.layers} layers, vocab {sz.vocab}; "
          f"batch {sz.batch} pairs of {sz.prompt_tokens}+{sz.target_tokens}+{sz.target_tokens} "
          f"tokens; B-only LoRA rank {sz.rank} on 7 projections x {sz.layers} layers; "
          f"1 thread; torch {torch.__version__}", flush=True)
    r = run(sz, with_trl=not args.no_trl, log=lambda *a: print(*a, flush=True))
    print(format_table(r))
    print(f"# load average 1 min before/after: {r['loadavg_1min_before']}/{r['loadavg_1min_after']}; "
          f"other processes used about {_f(r['other_processes_cores'], '.2f')} cores; "
          f"wall {r['wall_s']:.1f} s")
    if args.json:
        from admm_dist.core.io import atomic_write_json

        atomic_write_json(args.json, r)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
