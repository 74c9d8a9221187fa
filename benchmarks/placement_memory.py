"""Memory of a seat group at start: what each of a seat's k ranks holds once its backbone is loaded.

Run by :mod:`benchmarks.placement` (its memory table), one seat group per launch::

    python -m torch.distributed.run --standalone --nproc_per_node K -m benchmarks.placement_memory \\
        --model FOLDER --config FILE [--shard] --json PATH

Each of the K gloo ranks (one seat's group) loads the backbone through the trainer's own loader
(:func:`admm_dist.model.loading.load_model`: whole, or with ``--shard`` only its shard, as
``shard_backbone=true`` does, :mod:`admm_dist.model.sharding`) and builds the trainer's adapter
on it (:class:`~admm_dist.model.adapter.BOnlyLoRA` from ``--config``'s LoRA keys), then records:

- ``backbone_bytes`` and ``adapter_bytes``: bytes of the parameters it holds
  (:func:`~admm_dist.model.sharding.held_bytes`: of a sharded weight its local shard; the LoRA
  weights whole), the figures the trainer reports under ``memory``;
- ``rss_before``: its resident set (``VmRSS``) before the model, after the process group and
  the imports that loading it makes (the interpreter, torch, transformers, the model's modeling
  module, PEFT): the difference to ``peak_rss`` is what the model costs;
- ``rss_after``: its resident set once the adapter is built: what it keeps;
- ``peak_rss``: its peak resident set once the adapter is built (``VmHWM``, ``ru_maxrss``, and
  never below ``rss_after``: the kernel's counters lag by a few pages), the trainer's
  ``memory.peak_rss_start`` at this point of its set-up.

Rank 0 writes every rank's figures (gathered as an int64 tensor) to ``--json``, atomically.
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

from admm_dist.bench.common import Column, format_rows

FIELDS = ("backbone_bytes", "adapter_bytes", "rss_before", "rss_after", "peak_rss")
DEFAULT_MEMORY = ("standin", "smollm2")
DEFAULT_MEMORY_KS = (1, 2, 4)
MEMORY_MODELS = {"standin": "assets/standin", "smollm2": "assets/smollm2"}
SHARD_BOUND = 0.30                  # backbone bytes per rank at the largest k, sharded, over k = 1's


def vm_rss(field: str = "VmRSS") -> int:
    """This process's resident set (``VmRSS``) or its peak (``VmHWM``) in bytes (``/proc/self/status``)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _import_everything(model: str) -> None:
    """Import what loading ``model`` imports (its modeling module, PEFT), so that ``rss_before``
    holds the libraries and the difference to ``peak_rss`` is the model's."""
    import importlib

    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    importlib.import_module("peft")
    with init_empty_weights():
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))


def measure(model: str, config: str, shard: bool) -> Optional[Dict[str, List[int]]]:
    """Every rank's figures (on rank 0; None on the others)."""
    import datetime

    import torch
    import torch.distributed as dist

    from torch.distributed.device_mesh import DeviceMesh

    from admm_dist.model.adapter import BOnlyLoRA
    from admm_dist.model.loading import load_model
    from admm_dist.model.sharding import held_bytes
    from admm_dist.core import config_file
    from admm_dist.training.config import TrainConfig

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    backbone = adapter = None
    try:
        cfg = config_file.load(TrainConfig, ["--config", config, f"model_name={model}"])
        _import_everything(model)
        before = vm_rss()
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu") if shard and dist.get_world_size() > 1 else None
        backbone, _ = load_model(model, torch.device("cpu"), shard_over=mesh)
        adapter = BOnlyLoRA(backbone, cfg.adapter_config())
        after = vm_rss()          # the kernel's counters lag by a few pages: the peak is at least what
                                  # is held
        peak = max(after, vm_rss("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        row = torch.tensor([*held_bytes(adapter.model), before, after, peak], dtype=torch.int64)
        rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        dist.barrier()
        if dist.get_rank():
            return None
        return {f: [int(r[i]) for r in rows] for i, f in enumerate(FIELDS)}
    finally:
        # a sharded model's parameters hold the group's mesh (and FSDP's hooks make cycles): free
        # them while the group stands, not in the interpreter's finalization
        backbone = adapter = None
        gc.collect()
        dist.destroy_process_group()


def memory_command(k: int, model: str, config: str, shard: bool, json_path: str) -> List[str]:
    """The memory probe of one seat group of ``k`` ranks (:mod:`benchmarks.placement_memory`)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(k),
            "-m", "benchmarks.placement_memory", "--model", model, "--config", config,
            *(["--shard"] if shard else []), "--json", json_path]


def run_memory(models: Sequence[str], ks: Sequence[int], *, config: str, out: str, timeout_s: float,
               launch: Callable[[int, List[str], str, float], Any], log=print) -> List[Dict[str, Any]]:
    """One probe per (model, k, sharded or not), one after another: k = 1 whole, every larger k
    whole and sharded, each run by ``launch(k, command, log_path, timeout_s)`` (the placement
    benchmark's, which bounds it and raises on a failure). A model whose folder is missing is
    skipped with one line naming the fix."""
    import json

    rows: List[Dict[str, Any]] = []
    for name in models:
        folder = MEMORY_MODELS.get(name, name)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            log(f"# memory: {name}: no model folder {folder}: skipped (SmolLM2: bash launch/install.sh "
                f"smollm2 && python -m admm_dist.cli.pretrained smollm2 --out {MEMORY_MODELS['smollm2']})")
            continue
        for k in ks:
            for shard in ((False,) if k == 1 else (False, True)):
                where = os.path.join(out, "memory", f"{name}-k{k}{'-shard' if shard else ''}")
                shutil.rmtree(where, ignore_errors=True)
                os.makedirs(where)
                cmd = memory_command(k, folder, config, shard, os.path.join(where, "memory.json"))
                log(f"# memory: {name} k={k}{' sharded' if shard else ''}: {' '.join(cmd[1:])}")
                launch(k, cmd, os.path.join(where, "probe.log"), timeout_s)
                with open(os.path.join(where, "memory.json")) as fh:
                    rows.append({"model": name, "folder": folder, "k": k, "shard": shard, **json.load(fh)})
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["k"] == 1)
        r["param_ratio"] = max(r["backbone_bytes"]) / max(base["backbone_bytes"])
    return rows


def _mib(xs: Sequence[int]) -> str:
    return f"{max(xs) / 2 ** 20:.1f}"


MEMORY_COLUMNS = (
    Column("model", 8, lambda r: r["model"], "<"),
    Column("k", 2, lambda r: str(r["k"])),
    Column("sharded", 7, lambda r: "yes" if r["shard"] else "no", "<"),
    Column("backbone MiB/rank", 17, lambda r: _mib(r["backbone_bytes"])),
    Column("adapter MiB", 11, lambda r: _mib(r["adapter_bytes"])),
    Column("of k=1", 6, lambda r: f"{r['param_ratio']:.3f}"),
    Column("RSS before MiB", 14, lambda r: _mib(r["rss_before"])),
    Column("RSS after MiB", 13, lambda r: _mib(r["rss_after"])),
    Column("peak RSS MiB", 12, lambda r: _mib(r["peak_rss"])),
    Column("peak - before", 13, lambda r: _mib([p - b for p, b in zip(r["peak_rss"], r["rss_before"])])),
)


def format_memory(rows: Sequence[Dict[str, Any]]) -> str:
    """One row per (model, k, sharded); the largest figure over the k ranks of the seat group."""
    lines = format_rows(MEMORY_COLUMNS, rows)
    lines.append("per rank of one seat group of k ranks, the largest over its ranks: the parameter bytes it "
                 "holds of the backbone and of the adapter (LoRA A and B, whole on every rank); RSS before = "
                 "after the imports, before the model; after = once the adapter is built; peak = the most "
                 "resident by then (the sharded load's one-token forward and the backbone digest gather one "
                 "weight group at a time)")
    for model in dict.fromkeys(r["model"] for r in rows):
        top = max((r for r in rows if r["model"] == model and r["shard"]), key=lambda r: r["k"], default=None)
        if top is not None:
            verdict = "holds" if top["param_ratio"] <= SHARD_BOUND else "DOES NOT HOLD"
            lines.append(f"{model}: backbone bytes per rank at k={top['k']} sharded = "
                         f"{top['param_ratio']:.3f} of k=1's (bound {SHARD_BOUND:.2f}: {verdict})")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.placement_memory",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model folder (or hub id) of the backbone")
    ap.add_argument("--config", required=True, help="training config whose LoRA keys build the adapter")
    ap.add_argument("--shard", action="store_true", help="load each rank's shard only (shard_backbone=true)")
    ap.add_argument("--json", required=True, metavar="PATH", help="where rank 0 writes the figures")
    a = ap.parse_args(argv)
    figures = measure(a.model, a.config, a.shard)
    if figures is not None:
        from admm_dist.bench.common import write_json

        write_json(a.json, figures, message="")
    return 0


if __name__ == "__main__":
    # Leave without the interpreter's finalization, as the training command does
    # (admm_dist.cli.train._leave): a gloo worker thread that drops its last tensor while the
    # interpreter finalizes ends in std::terminate (seen as SIGABRT in this probe under load).
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
