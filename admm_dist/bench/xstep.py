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
  of the real ``Trainer.xstep`` with a proximal centre (rho 0.03, KL term kl_beta 0.1) runs
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

This module owns the run and the report: :func:`run` (the four parts in order, their fields
and the load around them: the JSON's dict), :func:`format_table` and the command line. The
set-up and the timed parts are in :mod:`admm_dist.bench.xstep_measure`, the load accounting in
:mod:`admm_dist.bench.common`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import sys
from typing import Any, Dict, Optional, Sequence

import torch

from admm_dist.bench.common import CpuWindow, hush_future_warnings, load_footer, loadavg, write_json
from admm_dist.bench.xstep_measure import QUICK, Sizes, bench_ours, bench_overhead, bench_trl, make_pairs, trl_version


def run(sz: Sizes, *, with_trl: bool = True, seed: int = 0, log=print) -> Dict[str, Any]:
    """The four parts one after the other, with the load around them: the JSON's dict."""
    torch.set_num_threads(1)
    load0 = loadavg()
    whole = CpuWindow.start()
    pairs = make_pairs(sz, sz.batch * (sz.warmup + sz.steps), seed)
    out: Dict[str, Any] = {"sizes": dataclasses.asdict(sz), "torch": torch.__version__,
                           "python": platform.python_version(), "cpu_cores": os.cpu_count()}
    try:
        import peft
        import transformers
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
    overhead = CpuWindow.start()
    out.update(bench_overhead(sz, seed + 1))
    _, out["overhead_other_processes_cores"] = overhead.stop()

    wall, other = whole.stop()
    out.update(wall_s=wall, loadavg_1min_before=load0, loadavg_1min_after=loadavg(),
               other_processes_cores=other)
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
    hush_future_warnings()
    print(f"# x-step benchmark: Qwen3 hidden {sz.hidden}, {sz.layers} layers, vocab {sz.vocab}; "
          f"batch {sz.batch} pairs of {sz.prompt_tokens}+{sz.target_tokens}+{sz.target_tokens} "
          f"tokens; B-only LoRA rank {sz.rank} on 7 projections x {sz.layers} layers; "
          f"1 thread; torch {torch.__version__}", flush=True)
    r = run(sz, with_trl=not args.no_trl, log=lambda *a: print(*a, flush=True))
    print(format_table(r))
    print(load_footer(r, missing="skipped"))
    if args.json:
        write_json(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
