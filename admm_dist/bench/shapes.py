"""The model shapes the benchmarks run on: one table, random weights, nothing downloaded.

=============  ======  ======  =====  ========  ========  ============  ======  ====
shape          hidden  layers  heads  kv_heads  head_dim  intermediate  vocab   tied
=============  ======  ======  =====  ========  ========  ============  ======  ====
micro              64       2      2         2        32           256     512  yes
tiny              256       4      4         4        64          1024    4096  yes
qwen3-0.6b       1024      28     16         8       128          3072  151936  yes
qwen3-8b         4096      36     32         8       128         12288  151936  no
=============  ======  ======  =====  ========  ========  ============  ======  ====

``tiny`` is the x-step benchmark's CPU model (its figures in docs/benchmarks.md were measured
on it) and ``micro`` its ``--quick`` model, which the CPU smoke run of ``launch/gpu_check.sh``
uses throughout (seconds on 2 cores); the two others are Qwen3-0.6B's and Qwen3-8B's
``config.json`` shapes (rope theta 1e6 and 40960 positions as there). A model of a shape is a
:func:`admm_dist.demo.tiny.random_qwen3`, built directly on its device in its dtype (bf16 on a
GPU: an 8B model never passes through the CPU), with
:func:`admm_dist.demo.tiny.padded_char_tokenizer` as the tokenizer where text must round-trip
(collection, training).

Save a backbone folder (what ``admm_dist.train`` and ``benchmarks.collect`` load)::

    python -m admm_dist.bench.shapes --save DIR --shape qwen3-0.6b [--device auto]

and ``python -m admm_dist.bench.shapes`` alone prints the table with each shape's parameter count.
This module also owns the benchmarks' ``--device`` choice (:func:`resolve_device`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, Optional, Sequence

DEVICES = ("cpu", "cuda", "auto")


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie: bool
    rope_theta: float = 10000.0
    max_positions: int = 2048

    def dims(self) -> Dict[str, Any]:
        """The shape keywords of :func:`admm_dist.demo.tiny.random_qwen3` (vocab aside)."""
        return dict(hidden=self.hidden, layers=self.layers, heads=self.heads, kv_heads=self.kv_heads,
                    head_dim=self.head_dim, intermediate=self.intermediate, tie=self.tie,
                    rope_theta=self.rope_theta, max_positions=self.max_positions)

    def n_params(self) -> int:
        """Parameters of the model (norms included), without building it."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + 2 * self.head_dim          # q, k, v, o and the q/k norms
        layer = attn + 3 * h * self.intermediate + 2 * h                # the MLP and two RMS norms
        embed = self.vocab * h
        return embed * (1 if self.tie else 2) + self.layers * layer + h


SHAPES: Dict[str, Shape] = {s.name: s for s in (
    Shape("micro", hidden=64, layers=2, heads=2, kv_heads=2, head_dim=32, intermediate=256,
          vocab=512, tie=True),
    Shape("tiny", hidden=256, layers=4, heads=4, kv_heads=4, head_dim=64, intermediate=1024,
          vocab=4096, tie=True),
    Shape("qwen3-0.6b", hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
          vocab=151936, tie=True, rope_theta=1_000_000.0, max_positions=40960),
    Shape("qwen3-8b", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
          vocab=151936, tie=False, rope_theta=1_000_000.0, max_positions=40960),
)}


def get(name: str) -> Shape:
    """The shape called ``name``; an unknown name is one ValueError naming the choices."""
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}: choose one of {', '.join(SHAPES)}") from None


def resolve_device(name: str):
    """``cpu``, ``cuda`` or ``auto`` (CUDA when present) as a torch device; ``cuda`` without a
    GPU is one ValueError."""
    import torch

    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}: choose one of {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device (use --device cpu or auto)")
    return torch.device(name)


def dtype_for(device):
    """bf16 on a GPU, fp32 on the CPU (as :func:`admm_dist.model.loading.load_model`)."""
    import torch

    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def build(shape: Shape, device="cpu", *, vocab: Optional[int] = None, seed: int = 0):
    """A random-weight ``Qwen3ForCausalLM`` of ``shape`` on ``device`` (bf16 on CUDA, fp32 on
    CPU); ``vocab`` overrides the shape's vocabulary size."""
    from admm_dist.demo.tiny import random_qwen3

    return random_qwen3(vocab or shape.vocab, seed=seed, device=device, dtype=dtype_for(device),
                        **shape.dims())


def save(shape: Shape, folder: str, device="cpu", *, seed: int = 0) -> Dict[str, Any]:
    """Write a random backbone of ``shape`` and its padded char tokenizer to ``folder``."""
    import torch

    from admm_dist.demo.tiny import save_random_backbone

    t0 = time.perf_counter()
    save_random_backbone(folder, shape.vocab, seed=seed, device=device, dtype=dtype_for(device),
                         **shape.dims())
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"shape": shape.name, "folder": os.path.abspath(folder), "device": str(device),
            "dtype": str(dtype_for(device)).replace("torch.", ""), "params": shape.n_params(),
            "seconds": round(time.perf_counter() - t0, 2)}


def format_table() -> str:
    head = (f"{'shape':<11} {'hidden':>6} {'layers':>6} {'heads':>5} {'kv':>3} {'head_dim':>8} "
            f"{'inter':>6} {'vocab':>7} {'tied':>4} {'params':>8}")
    lines = [head, "-" * len(head)]
    for s in SHAPES.values():
        lines.append(f"{s.name:<11} {s.hidden:>6} {s.layers:>6} {s.heads:>5} {s.kv_heads:>3} {s.head_dim:>8} "
                     f"{s.intermediate:>6} {s.vocab:>7} {'yes' if s.tie else 'no':>4} "
                     f"{s.n_params() / 1e9:>7.3f}B")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m admm_dist.bench.shapes", description=__doc__.splitlines()[0])
    ap.add_argument("--save", metavar="DIR", help="write a random backbone of --shape to DIR")
    ap.add_argument("--shape", default="tiny", choices=list(SHAPES), help="the shape (default tiny)")
    ap.add_argument("--device", default="cpu", choices=DEVICES, help="build it there (default cpu)")
    ap.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    a = ap.parse_args(argv)
    if not a.save:
        print(format_table())
        return 0
    try:
        device = resolve_device(a.device)
    except ValueError as e:
        ap.error(str(e))
    print(json.dumps(save(get(a.shape), a.save, device, seed=a.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
