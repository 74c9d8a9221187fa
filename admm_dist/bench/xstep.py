"""x-step benchmark: one local DPO Adam step of this project vs TRL's DPOTrainer, and the round overhead.

Run::

    python -m admm_dist.bench.xstep [--json PATH] [--shape micro|tiny|qwen3-0.6b|qwen3-8b]
        [--device cpu|cuda|auto] [--steps 20] [--warmup 3] [--batch 8] [--rounds 6]
        [--no-trl] [--no-overhead] [--quick]

Set-up, the same for every row. A randomly initialised ``Qwen3ForCausalLM`` of ``--shape``
(:mod:`admm_dist.bench.shapes`; the default ``tiny``: hidden 256, 4 layers, 4 heads,
intermediate 1024, vocab 4096, tied embeddings; seed 0; built by
:func:`admm_dist.demo.tiny.random_qwen3` directly on the device, fp32 on the CPU and bf16
on CUDA, nothing downloaded) and a WordLevel tokenizer over the shape's vocabulary (3
specials and synthetic words ``w0 w1 ...``, whitespace pre-tokenizer) in a
``PreTrainedTokenizerFast``. The data are ``batch * (warmup + steps)`` random DPO pairs: a
prompt of ``prompt_tokens`` and a chosen and a rejected completion of ``target_tokens`` each
(64/64 on ``tiny``, 512/256 on the Qwen3 shapes; words and the EOS token; a completion
starts with a space and ends with the EOS string, so that TRL's tokenization of prompt +
completion gives exactly these tokens and adds no second EOS). Each row uses a fresh model,
one torch thread (``torch.set_num_threads(1)``), batch 8 pairs (4 on the Qwen3 shapes), a
rank-16 LoRA (alpha 16) on all seven projections (q, k, v, o, gate, up, down) of every layer
with lora_A frozen, DPO beta 0.1, learning rate 1e-3, gradient-norm clip 0.01, constant rate.
Gradient checkpointing (non-reentrant) is on for both sides on CUDA and off on the CPU.

Rows (seconds per optimizer step):

- ``ours_s``: this project's x-step. A :class:`admm_dist.training.trainer.Trainer` (single-process
  backend, ``local_steps = warmup + steps``) whose only replaced methods are ``load_data``
  (returns the pairs above) and ``load_backbone`` (returns the random model and tokenizer);
  ``setup()`` and ``build_nodes()`` run unchanged (BOnlyLoRA, encode, the reference
  log-probs computed once by ``precompute_reference``, the role-balanced sampler, Adam on
  ``adapter.param``), with ``no_grad_checkpointing`` as above. One call of the real
  ``Trainer.xstep`` with a proximal centre (rho 0.03, KL term kl_beta 0.1) runs all the
  steps; an optimizer step post-hook ends each step: sampling, ``collate``, ``loss`` (one
  forward of chosen + rejected), backward, proximal gradient, clip and Adam.
  ``ours_precompute_s`` is the time of ``build_nodes()`` (tokenization and the reference
  pass over every pair), once.
- ``trl_s``: TRL's ``DPOTrainer`` with its defaults for the step (the reference log-probs
  computed every step with the adapter disabled), given the plain model and a peft
  ``LoraConfig``; ``bf16`` and ``gradient_checkpointing`` on CUDA only, ``use_cpu`` on the
  CPU, ``max_steps = warmup + steps``, no logging, saving or evaluation, its default
  optimizer (AdamW, weight decay 0). lora_A is frozen on ``trainer.model`` after the trainer
  is built and before ``train()``, so TRL trains exactly as many B entries as ``numel_b``.
  A ``TrainerCallback``'s ``on_step_end`` ends each step, so a step covers what ours covers
  (fetching and collating the batch, forward(s), backward, clip, optimizer, scheduler,
  zero_grad); ``on_step_begin`` to ``on_step_end`` (no batch fetch) is also kept as
  ``trl_inner_s`` / ``trl_precompute_inner_s``.
- ``trl_precompute_s``: the same with ``precompute_ref_log_probs=True``. TRL computes the
  reference log-probs of the whole data set once, inside the trainer's constructor; that
  call (``_precompute_ref_logps``) is timed by itself and reported as
  ``trl_precompute_ref_s``, never as a step.

The rows run interleaved (:mod:`admm_dist.bench.interleave`): each is built in turn, then
their steps go in rotation (ours step k, TRL step k, TRL precompute step k, then step k + 1),
one thread computing at a time, each step timed from handing the row its turn to getting it
back (after a CUDA synchronize on a GPU). Timing the rows one after another let load that
shifted between them move the ratio (two such runs gave TRL/ours 2.49 and 3.98). For every
row the first ``warmup`` steps are dropped and its value is the median of the next
``steps``; every step time is in the JSON. ``trl_over_ours`` and ``trl_precompute_over_ours``
divide the TRL medians by ``ours_s``; ``trl_over_ours_paired`` and
``trl_precompute_over_ours_paired`` (the ``paired`` column) are the medians of the
per-rotation ratios (TRL's step k over ours' step k, kept as ``*_paired_ratios``), the
steadier figure. On CUDA, ``*_peak_gib`` is the row's GPU memory at its peak: what the row
holds (its build and earlier steps) plus the step's rise in ``torch.cuda.max_memory_allocated``,
reset before every step; the max over the timed steps. If ``trl`` cannot be imported (it is
not a dependency of this package: ``pip install trl``), the TRL rows are skipped with a
one-line message and their fields are null.

``overhead_share`` (CPU only; ``--no-overhead`` skips it, and it is skipped on CUDA): the share
of an ADMM round's wall time spent outside the x-steps, with 3 gloo CPU ranks
(:func:`admm_dist.bench.launcher.launch_cpu`, one torch thread each, consensus ``ring``),
each rank a real Trainer built as above (its own pairs, ``local_steps`` 16) and running
``trainer.engine.step(trainer.xstep)``. Per round, from the engine's
:class:`~admm_dist.engine.admm.RoundRecord` (gathered from every rank): wall = max over ranks of
``sec_x + sec_z + sec_other``, x = max over ranks of ``sec_x``, share = (wall - x) / wall;
the first round is a warm-up, ``overhead_share`` is the median over the other rounds.
``overhead_share_step_wall`` is the same with wall = max over ranks of the time of the whole
``engine.step`` call (it also covers the telemetry gather). The 3 ranks share the machine's
cores (2 on the reference machine: oversubscribed, reported as ``oversubscribed``), so their
x-steps are slower than ``ours_s`` and a fast rank waits for the slowest one inside the
z-step.

The load average before and after and the cores used by other processes are reported.
``--quick`` (or ``--shape micro``) is a smoke test: the micro shape (hidden 64, 2 layers,
vocab 512), batch 2, 8-token texts, rank 4, 3 steps after 1 warm-up, 2 local steps, 1 + 2 rounds.

This module owns the run and the report: :func:`run` (the rows in rotation, then the overhead
part, their fields and the load around them: the JSON's dict), :func:`format_table` and the
command line. The set-up and the timed parts are in :mod:`admm_dist.bench.xstep_measure`, the
rotation in :mod:`admm_dist.bench.interleave`, the load accounting in :mod:`admm_dist.bench.common`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import statistics
import sys
from typing import Any, Dict, Optional, Sequence

import torch

from admm_dist.bench.common import CpuWindow, hush_future_warnings, load_footer, loadavg, write_json
from admm_dist.bench.interleave import Row, paired_ratios, rotate, summary
from admm_dist.bench.shapes import DEVICES, SHAPES, dtype_for, resolve_device
from admm_dist.bench.xstep_measure import (QUICK, TIMEOUT_S, Sizes, bench_overhead, make_pairs, ours_row,
                                           sizes_for, trl_row, trl_version)

TRL_FIELDS = ("trl_s", "trl_precompute_s", "trl_over_ours", "trl_precompute_over_ours",
              "trl_over_ours_paired", "trl_precompute_over_ours_paired", "trl_cpu_s", "trl_precompute_cpu_s",
              "trl_over_ours_paired_cpu", "trl_precompute_over_ours_paired_cpu",
              "trl_precompute_ref_s", "trl_inner_s", "trl_precompute_inner_s")
OVERHEAD_FIELDS = ("overhead_share", "overhead_share_step_wall", "overhead_rounds", "overhead_nprocs",
                   "overhead_local_steps", "overhead_x_s_per_step", "oversubscribed")


def run(sz: Sizes, *, with_trl: bool = True, seed: int = 0, log=print, device="cpu",
        overhead: bool = True) -> Dict[str, Any]:
    """The rows in rotation, then the overhead part, with the load around them: the JSON's dict."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    torch.set_num_threads(1)
    load0 = loadavg()
    whole = CpuWindow.start()
    pairs = make_pairs(sz, sz.batch * (sz.warmup + sz.steps), seed)
    out: Dict[str, Any] = {"sizes": dataclasses.asdict(sz), "torch": torch.__version__,
                           "python": platform.python_version(), "cpu_cores": os.cpu_count(),
                           "device": device.type, "device_name": _device_name(device),
                           "dtype": str(dtype_for(device)).replace("torch.", ""), "method": "interleaved"}
    try:
        import peft
        import transformers
        out.update(transformers=transformers.__version__, peft=peft.__version__)
    except ImportError:  # pragma: no cover - both are dependencies
        pass

    version = trl_version() if with_trl else None
    out["trl"] = version
    out.update({k: None for k in TRL_FIELDS})
    n = sz.warmup + sz.steps
    rows = [Row("ours", ours_row(sz, pairs, device), n, TIMEOUT_S)]
    if not with_trl:
        log("# TRL rows skipped (--no-trl)")
        out["trl_skipped"] = "--no-trl"
    elif version is None:
        log("# trl is not importable: TRL rows skipped (pip install trl to compare with TRL)")
        out["trl_skipped"] = "trl not importable"
    else:
        rows += [Row("trl", trl_row(sz, pairs, False, device), n, TIMEOUT_S),
                 Row("trl_precompute", trl_row(sz, pairs, True, device), n, TIMEOUT_S)]
    log(f"# (a{'-c' if len(rows) > 1 else ''}) {', '.join(r.name for r in rows)}: {sz.warmup}+{sz.steps} "
        f"steps each, in rotation{f' (TRL {version} DPOTrainer)' if len(rows) > 1 else ''} ...")
    with _quiet_libraries():
        rotate(rows, cuda=cuda, log=log)
    torch.set_num_threads(1)

    ours = summary(rows[0], sz.warmup)
    out.update(ours_s=ours["median_s"], ours_step_times_s=ours["step_times_s"],
               ours_warmup_times_s=ours["warmup_times_s"], ours_cpu_s=ours["cpu_median_s"],
               ours_cpu_step_times_s=ours["cpu_step_times_s"], ours_peak_gib=ours.get("peak_gib"),
               ours_process_peak_gib=ours.get("process_peak_gib"), **rows[0].result)
    for row in rows[1:]:
        key, r, res = row.name, summary(row, sz.warmup), row.result
        ratios = paired_ratios(r["step_times_s"], ours["step_times_s"])
        out[f"{key}_s"] = r["median_s"]
        out[f"{key}_over_ours"] = r["median_s"] / out["ours_s"]
        out[f"{key}_over_ours_paired"] = statistics.median(ratios)
        out[f"{key}_paired_ratios"] = ratios
        cpu_ratios = paired_ratios(r["cpu_step_times_s"], ours["cpu_step_times_s"])
        out[f"{key}_cpu_s"] = r["cpu_median_s"]
        out[f"{key}_cpu_step_times_s"] = r["cpu_step_times_s"]
        out[f"{key}_over_ours_paired_cpu"] = statistics.median(cpu_ratios)
        out[f"{key}_paired_cpu_ratios"] = cpu_ratios
        out[f"{key}_inner_s"] = res["inner_median_s"]
        out[f"{key}_step_times_s"] = r["step_times_s"]
        out[f"{key}_warmup_times_s"] = r["warmup_times_s"]
        out[f"{key}_inner_step_times_s"] = res["inner_step_times_s"]
        out[f"{key}_build_s"] = res["construct_s"]
        out[f"{key}_peak_gib"] = r.get("peak_gib")
        out[f"{key}_process_peak_gib"] = r.get("process_peak_gib")
        out[f"{key}_lora_a_frozen"] = res["lora_a_frozen"]
        out[f"{key}_trainable_params"] = res["trainable_params"]
        out[f"{key}_token_lengths"] = res["token_lengths_prompt_chosen_rejected"]
        out[f"{key}_threads"] = res["threads"]
        out[f"{key}_gradient_checkpointing"] = res["gradient_checkpointing"]
        if key == "trl_precompute":
            out["trl_precompute_ref_s"] = res["precompute_ref_s"]

    out.update({k: None for k in OVERHEAD_FIELDS})
    if not overhead:
        out["overhead_skipped"] = "--no-overhead"
    elif cuda:
        out["overhead_skipped"] = "the overhead part runs on gloo CPU ranks (--device cpu)"
        log(f"# overhead part skipped: {out['overhead_skipped']}")
    else:
        log(f"# (d) overhead: {sz.nprocs} gloo ranks, local_steps {sz.local_steps}, "
            f"1+{sz.rounds - 1} rounds ...")
        window = CpuWindow.start()
        out.update(bench_overhead(sz, seed + 1))
        _, out["overhead_other_processes_cores"] = window.stop()

    wall, other = whole.stop()
    out.update(wall_s=wall, loadavg_1min_before=load0, loadavg_1min_after=loadavg(),
               other_processes_cores=other)
    return out


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


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
    mem = r.get("ours_peak_gib") is not None
    cpu = r.get("device", "cpu") == "cpu"
    head = f"{'row':<44} {'s/step':>8} {'/ ours':>7} {'paired':>7}"
    head += f" {'cpu s':>8} {'paired':>7}" if cpu else ""
    head += f" {'peak GiB':>9}" if mem else ""
    lines = [head, "-" * len(head)]

    def line(label: str, key: str, ratio: Optional[float], paired: Optional[float],
             paired_cpu: Optional[float]) -> str:
        text = (f"{label:<44} {_f(r[f'{key}_s'], '8.4f'):>8} {_f(ratio, '7.2f'):>7} "
                f"{_f(paired, '7.2f'):>7}")
        if cpu:
            text += f" {_f(r.get(f'{key}_cpu_s'), '8.4f'):>8} {_f(paired_cpu, '7.2f'):>7}"
        return text + (f" {_f(r.get(f'{key}_peak_gib'), '9.2f'):>9}" if mem else "")

    lines.append(line("ours_s  (Trainer.xstep, ref precomputed)", "ours", 1.0, 1.0, 1.0))
    for key, label in (("trl", "trl_s  (DPOTrainer default)"),
                       ("trl_precompute", "trl_precompute_s  (precompute_ref_log_probs)")):
        lines.append(line(label, key, r[f"{key}_over_ours"], r[f"{key}_over_ours_paired"],
                          r[f"{key}_over_ours_paired_cpu"]))
    lines.append("-" * len(head))
    lines.append(f"steps in rotation (ours, TRL, TRL precompute), {sz['warmup']} warm-up + {sz['steps']} "
                 f"timed each; / ours: ratio of the medians; paired: median of the {sz['steps']} "
                 "per-rotation ratios"
                 + ("; cpu: the row thread's CPU time per step, its paired ratio after it" if cpu else ""))
    n_pairs = sz["batch"] * (sz["warmup"] + sz["steps"])
    lines.append(f"one-off reference pass: ours {r['ours_precompute_s']:.2f} s, TRL "
                 f"{_f(r['trl_precompute_ref_s'], '.2f')} s ({n_pairs} pairs)")
    if r["trl_s"] is not None:
        lines.append(f"TRL on_step_begin->on_step_end (no batch fetch): default "
                     f"{r['trl_inner_s']:.4f} s, precompute {r['trl_precompute_inner_s']:.4f} s")
    if mem:
        lines.append("peak GiB: the row's own resident memory + its step's rise (max_memory_allocated, "
                     "reset per step), max over the timed steps")
    if r["overhead_share"] is None:
        lines.append(f"overhead_share skipped: {r.get('overhead_skipped')}")
    else:
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
    ap.add_argument("--shape", default=None, choices=list(SHAPES),
                    help="the model's shape (admm_dist.bench.shapes; default tiny, --quick micro)")
    ap.add_argument("--device", default="cpu", choices=DEVICES,
                    help="cpu (default), cuda, or auto (CUDA when present); on CUDA: bf16, "
                         "gradient checkpointing, peak memory per row, no overhead part")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per row after the warm-up (default 20, real shapes 6; --quick 3)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up steps (default 3, real shapes 2; --quick 1)")
    ap.add_argument("--batch", type=int, default=None, help="pairs per step (default 8, real shapes 4)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="ADMM rounds of the overhead part, the first a warm-up (default 6; --quick 3)")
    ap.add_argument("--no-trl", action="store_true", help="skip the TRL rows")
    ap.add_argument("--no-overhead", action="store_true", help="skip the overhead part (gloo CPU ranks)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: the micro shape, few steps (= --shape micro)")
    args = ap.parse_args(argv)
    if args.quick and args.shape not in (None, "micro"):
        ap.error(f"--quick is --shape micro: drop --shape {args.shape} or --quick")
    sz = QUICK if args.quick else sizes_for(args.shape or "tiny")
    over = {k: v for k, v in (("steps", args.steps), ("warmup", args.warmup), ("batch", args.batch),
                              ("rounds", args.rounds)) if v is not None}
    sz = dataclasses.replace(sz, **over)
    if sz.steps < 1 or sz.warmup < 0 or sz.batch < 1:
        ap.error("--steps and --batch must be >= 1 and --warmup >= 0")
    if sz.rounds < 2 and not args.no_overhead:
        ap.error("--rounds must be >= 2 (the first is a warm-up)")
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        ap.error(str(e))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    hush_future_warnings()
    print(f"# x-step benchmark: Qwen3 of shape {sz.shape} (hidden {sz.hidden}, {sz.layers} layers, vocab "
          f"{sz.vocab}) on {device.type} in {str(dtype_for(device)).replace('torch.', '')}; batch {sz.batch} "
          f"pairs of {sz.prompt_tokens}+{sz.target_tokens}+{sz.target_tokens} tokens; B-only LoRA rank "
          f"{sz.rank} on 7 projections x {sz.layers} layers; 1 thread; torch {torch.__version__}", flush=True)
    r = run(sz, with_trl=not args.no_trl, log=lambda *a: print(*a, flush=True), device=device,
            overhead=not args.no_overhead)
    print(format_table(r))
    print(load_footer(r, missing="skipped"))
    if args.json:
        write_json(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
