"""Compressed payloads: int8 or fp8 (e4m3) codes with one fp32 scale per block of values.

A vector of P values is cut into blocks of :data:`BLOCK` (the last one shorter); each block
gets the scale ``absmax / qmax`` (qmax 127 for int8, 448 for e4m3), and each value the code
``value / scale`` rounded to the format (int8: to the nearest integer, halves to even; fp8: to
the nearest e4m3 value). The wire payload is one ``uint8`` buffer: the blocks' fp32 scales,
then P code bytes, so the meter and the wire count the scales too. A payload decodes to the
same fp32 values on every rank (codes times scales, one multiplication per value), which is
what lets every holder of a public copy keep it bit-identical to the sender's.

The compressor is deterministic and contractive (||v - Q(v)|| <= delta ||v||, delta < 1), the
class CHOCO-Gossip (Koloskova, Stich, Jaggi 2019) converges with. Compressing a vector itself
stalls at the quantization error; :mod:`~admm_dist.engine.comm.compressed` therefore sends a
node's *change* against a public copy (h <- h + Q(v - h)), whose error vanishes as it settles.
"""
from __future__ import annotations

import math
from typing import Dict

import torch

from admm_dist.core.errors import UserError

COMPRESSIONS = ("none", "int8", "fp8")
BLOCK = 64                        # values per fp32 scale: int8 costs (1 + 4/64) / 4 = 0.27 of fp32
_QMAX: Dict[str, float] = {"int8": 127.0, "fp8": 448.0}


def check_compress(compress: str) -> str:
    if compress not in COMPRESSIONS:
        raise UserError(f"compress={compress!r} is unknown: choose one of {', '.join(COMPRESSIONS)}")
    if compress == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise UserError(f"compress=fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} lacks: "
                        "use compress=int8 or a newer torch")
    return compress


def n_blocks(numel: int) -> int:
    return max(1, math.ceil(numel / BLOCK))


def payload_bytes(numel: int, compress: str) -> int:
    """Bytes of one compressed vector of ``numel`` fp32 values (codes + scales); 4 per value for none."""
    if compress == "none":
        return 4 * numel
    return numel + 4 * n_blocks(numel)


def _blocked(v: torch.Tensor) -> torch.Tensor:
    """``v`` (fp32, 1-D) zero-padded to whole blocks, as [blocks, BLOCK]."""
    nb = n_blocks(v.numel())
    return torch.nn.functional.pad(v, (0, nb * BLOCK - v.numel())).view(nb, BLOCK)


def encode(v: torch.Tensor, compress: str) -> torch.Tensor:
    """The payload of ``v`` (fp32, 1-D): a uint8 buffer of ``payload_bytes(v.numel(), compress)``."""
    p = v.numel()
    blocks = _blocked(v.float())
    absmax = blocks.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / _QMAX[compress], torch.ones_like(absmax))
    scaled = blocks / scale[:, None]
    if compress == "int8":
        codes = scaled.round().clamp_(-127, 127).to(torch.int8)
    else:
        codes = scaled.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    return torch.cat([scale.to(torch.float32).view(torch.uint8), codes.reshape(-1)[:p].view(torch.uint8)])


def decode_(out: torch.Tensor, payload: torch.Tensor, compress: str) -> torch.Tensor:
    """``out`` (fp32, 1-D, the vector's length) := the values ``payload`` encodes."""
    p = out.numel()
    nb = n_blocks(p)
    scale = payload[:4 * nb].view(torch.float32)   # first, so the fp32 view is aligned
    codes = payload[4 * nb:4 * nb + p].view(torch.int8 if compress == "int8" else torch.float8_e4m3fn)
    codes = torch.nn.functional.pad(codes.to(torch.float32), (0, nb * BLOCK - p))
    out.copy_((codes.view(nb, BLOCK) * scale[:, None]).reshape(-1)[:p])
    return out
