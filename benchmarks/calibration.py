"""The plan checked against measurement: what ``python -m admm_dist.plan`` predicts for a rank
(:func:`admm_dist.training.rehearsal.rehearse`, fake tensors in a fake world) beside what a real
gloo rank of the same job holds, for the stand-in and SmolLM2-135M at k = 1, 2 and 4 ranks per
seat, whole and sharded (2 seats: W = 2k ranks; a seat's leader and a follower, the two kinds)::

    python -m benchmarks.calibration [--models standin,smollm2] [--ks 1,2,4] [--json PATH]

Each real rank runs the rehearsal's own round (:func:`~admm_dist.training.rehearsal.round_memory`:
the adapter built, reference log-probs, one x-step of every seat it holds, consensus) on the real
backbone, counted two ways:

- **tensor bytes per category**, every storage from birth to free
  (:class:`~admm_dist.model.fake_run.Counting`), against the plan's: within ``CATEGORY_BOUND``
  (10%) of the measured value, categories of at least ``FLOOR`` bytes (smaller ones within
  ``FLOOR``);
- **peak resident set**: the rank's ``VmHWM`` from the backbone's load through the round (reset
  through ``/proc/self/clear_refs``) less its resident baseline (``VmRSS`` with the libraries, the
  process group and the communicator in place, before the backbone is read), against the plan's peak:
  within ``PEAK_BOUND`` (20%) of the measured value. The baseline is taken once a warm-up round
  of 8 + 4 tokens has run on the same backbone (then freed): the code its kernels page in, the
  threads and the buffers they keep are the runtime's, not the job's.

Every run is ``CONFIG``'s (DPO, LoRA rank 4 on the last 2 layers) on the model, with its examples
cut to ``--prompt`` + ``--target`` tokens and ``--batch`` examples (the stand-in's CPU default
holds a few MiB; longer rows make the activations, the part a plan can get wrong, the bulk of its
peak). The ranks run with glibc's
mmap threshold fixed at ``MMAP_THRESHOLD`` (``--malloc_mmap_threshold``; 0 for glibc's default), so
that a freed tensor's pages leave the resident set, as a GPU's caching allocator's blocks are
reused: what is left is what the plan counts against what the process holds. Prints a markdown table
(docs/benchmarks.md holds it) and exits 1 if a row is out of its bounds.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import os
import sys
from typing import Any, Dict, List, Sequence

from benchmarks.placement_memory import vm_rss

CATEGORY_BOUND = 0.10
PEAK_BOUND = 0.20
FLOOR = 64 * 1024            # bytes: categories smaller than this are compared in absolute terms
# glibc's malloc hands an allocation of at least this many bytes its own pages, returned at free:
# at its default (a threshold that rises to 32 MiB as blocks are freed) the heap keeps the freed
# blocks of a step, and the stand-in's peak resident set is 1.4x its tensors' (benchmarks.md)
MMAP_THRESHOLD = 65536
# what a sharded stand-in rank holds beyond its plan (10-21 MiB at k = 2 and 4, from run to run:
# anonymous memory that no tensor accounts for: it grows by 13-26 MiB with each x-step of a sharded
# rank while the count stays at 3 MiB, none with a whole backbone, and all of it is freed with the
# model: FSDP2's, outside the storages the count sees; not found yet); SmolLM2's sharded rows hold
# 30-55 MiB more, within PEAK_BOUND
SHARDED_EXCESS = 24 << 20
# a gloo worker thread drops a completed message's tensors a moment after the wait on it returns:
# on a loaded machine the count at the round's end can still hold one piece (at most 256 KiB where
# a hop has one piece; 160 KiB of the stand-in's was seen in a CI run) as kept by consensus
IN_FLIGHT = 256 << 10
MODELS = {"standin": "assets/standin", "smollm2": "assets/smollm2"}
# the CPU ADMM config (DPO pairs from a fit set: a sharded seat group trains from one, never on
# its own rollouts), its backbone replaced
CONFIG = "configs/cpu/admm_ring.yaml"


def _settle() -> None:
    """Free Python's garbage and hand the C heap's free pages back, so a resident figure holds what
    is live."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass


class RealRank:
    """One real rank of a job, built as the trainer builds it (its placement, communicator and
    mesh; its backbone loaded, whole or sharded, on demand), whose round the rehearsal's own
    :func:`~admm_dist.training.rehearsal.round_memory` runs and counts."""

    def __init__(self, ctx, argv: Sequence[str]):
        from admm_dist.core import config_file
        from admm_dist.engine.placement import Placement
        from admm_dist.training import pipeline
        from admm_dist.training.config import TrainConfig
        from admm_dist.training.trainer import build_communicator

        self.ctx, self.cfg = ctx, config_file.load(TrainConfig, list(argv))
        placement = Placement(self.cfg.n_nodes(), ctx.world_size)
        collects = pipeline.needs_collection(self.cfg)
        self.comm, self.mesh = build_communicator(self.cfg, ctx, placement, collects)

    def load(self):
        from admm_dist.model.loading import load_model

        return load_model(self.cfg.model_name, self.ctx.device, dtype=self.cfg.dtype,
                          shard_over=self.mesh.shard if self.cfg.shard_backbone else None)[0]

    def round(self, model, cfg=None):
        """(memory by category, counted peak, bytes sent by category) of one round on ``model``."""
        import torch

        from admm_dist.model.fake_run import Counting
        from admm_dist.training.rehearsal import round_memory

        with Counting() as run:
            return round_memory(cfg or self.cfg, run, model, self.comm, self.mesh.seat, torch.device("cpu"))


def measure_rank(ctx, argv: Sequence[str]) -> Dict[str, Any]:
    """One real gloo rank of the job ``argv``: its counted categories and peak, and its resident
    baseline and peak over the round (bytes)."""
    import peft  # noqa: F401  (imported by the adapter: part of the runtime, not of the model)

    rank = RealRank(ctx, argv)
    # the runtime's baseline: once a round of 8 + 4 tokens has run (the kernels' code paged in, the
    # threads and their buffers made), its model freed
    rank.round(rank.load(), dataclasses.replace(rank.cfg, max_prompt_tokens=8, max_target_tokens=4))
    _settle()
    base = vm_rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:     # the peak resident set starts again from here
        fh.write("5")
    memory, peak, _ = rank.round(rank.load())
    return {"memory": memory, "peak": peak, "rss_base": base, "rss_peak": vm_rss("VmHWM")}


def job_argv(name: str, k: int, shard: bool, prompt: int, target: int, batch: int) -> List[str]:
    return ["--config", CONFIG, f"model_name={MODELS[name]}", "n_agents=2", f"micro_batches={k}",
            f"batch_size={batch}", f"max_prompt_tokens={prompt}", f"max_target_tokens={target}",
            f"shard_backbone={'true' if shard else 'false'}"]


def compare(plan, measured: Dict[str, Any]) -> Dict[str, Any]:
    """The plan against one measured rank: the worst category's error, the peak's, in bounds."""
    worst, worst_cat = 0.0, None
    for c, got in measured["memory"].items():
        err = abs(plan.memory[c] - got) / got if got >= FLOOR else abs(plan.memory[c] - got) / FLOOR
        if err > worst:
            worst, worst_cat = err, c
    rss = measured["rss_peak"] - measured["rss_base"]
    peak_err = (plan.peak - rss) / rss
    return {"category_err": worst, "category": worst_cat,
            "categories": {c: [plan.memory[c], got] for c, got in measured["memory"].items()},
            "counted_peak": measured["peak"], "rss_peak": rss,
            "plan_peak": plan.peak, "peak_err": peak_err,
            "ok": worst <= CATEGORY_BOUND and abs(peak_err) <= PEAK_BOUND}


def calibrate(name: str, k: int, shard: bool, prompt: int, target: int, batch: int,
              timeout_s: float = 600) -> List[Dict[str, Any]]:
    """Rows of one job (2 seats on 2k ranks): the leader and, for k > 1, a follower."""
    from admm_dist.bench.launcher import launch_cpu
    from admm_dist.core import config_file
    from admm_dist.training.config import TrainConfig
    from admm_dist.training.rehearsal import rehearse

    argv = job_argv(name, k, shard, prompt, target, batch)
    cfg = config_file.load(TrainConfig, argv)
    measured = launch_cpu(measure_rank, 2 * k, argv, timeout_s=timeout_s)
    rows = []
    for rank in ((0,) if k == 1 else (0, 1)):
        plan = rehearse(cfg, 2 * k, rank, device="cpu")
        rows.append({"model": name, "k": k, "sharded": shard, "kind": plan.kind,
                     **compare(plan, measured[rank])})
    return rows


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def table(rows: Sequence[Dict[str, Any]]) -> str:
    out = ["| model | k | backbone | rank | worst category: error | counted peak MiB | plan peak MiB "
           "| resident peak - baseline MiB | plan - resident | in bounds |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['model']} | {r['k']} | {'sharded' if r['sharded'] else 'whole'} | {r['kind']} "
                   f"| {r['category'] or '-'}: {100 * r['category_err']:.1f}% | {_mib(r['counted_peak'])} "
                   f"| {_mib(r['plan_peak'])} | {_mib(r['rss_peak'])} | {100 * r['peak_err']:+.1f}% "
                   f"| {'yes' if r['ok'] else '**no**'} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="standin,smollm2")
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--target", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--malloc_mmap_threshold", type=int, default=MMAP_THRESHOLD,
                    help="glibc's mmap threshold for the ranks, bytes (0: glibc's own, dynamic)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    # read by glibc when a process starts: set before the first launch starts the ranks' server
    if args.malloc_mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    rows: List[Dict[str, Any]] = []
    for name in args.models.split(","):
        if name not in MODELS:
            ap.error(f"--models: {name!r} is not one of {', '.join(MODELS)}")
        folder = MODELS[name]
        if not os.path.isfile(os.path.join(folder, "config.json")):
            print(f"# {name}: no model folder {folder}: skipped (python -m admm_dist.cli.pretrained "
                  f"smollm2 --out {folder})", file=sys.stderr)
            continue
        for k in (int(x) for x in args.ks.split(",")):
            for shard in ((False,) if k == 1 else (False, True)):
                rows.extend(calibrate(name, k, shard, args.prompt, args.target, args.batch))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    if args.json:
        from admm_dist.core.io import atomic_write_json
        atomic_write_json(args.json, rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
