"""Compressed payloads: int8, fp8 (e4m3) or int4 codes with one fp32 scale per block of values.

A vector of P values is cut into blocks of :data:`BLOCK` (the last one shorter); each block gets
the scale ``absmax / qmax`` (qmax 127 for int8, 448 for e4m3, 7 for int4), and each value the code
``value * (qmax / absmax)`` rounded to the format (int8 and int4: to the nearest integer, halves to
even; fp8: to the nearest e4m3 value; int4 codes are stored biased by 8, two to a byte, the first
value in the low nibble). A payload is one ``uint8`` buffer, block after block, each block its
fp32 scale then its codes, so the meter and the wire count the scales too, and any cut at a block
boundary is a payload of its own: the transport encodes, sends and decodes a message piece by
piece (:meth:`Communicator.relay`). A payload decodes to the same fp32 values on every rank (codes
times scale, one multiplication per value), which is what lets every holder of a public copy keep
it bit-identical to the sender's, however the message was cut.

The compressor is deterministic and contractive (||v - Q(v)|| <= delta ||v||, delta < 1), the
class CHOCO-Gossip (Koloskova, Stich, Jaggi 2019) converges with. Compressing a vector itself
stalls at the quantization error; :mod:`admm_dist.engine.comm.compressed` therefore sends a
node's *change* against a public copy (h <- h + Q(v - h)), whose error vanishes as it settles.
A codec runs in place on the vector's device, into scratch buffers it keeps: one pass per step
of torch (absmax, multiply, round, cast; decode: cast, multiply), no float64 and no temporaries
of the whole vector.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from admm_dist.core.errors import UserError

COMPRESSIONS = ("none", "int8", "fp8", "int4")
BLOCK = 64                        # values per fp32 scale: int8 costs (1 + 4/64) / 4 = 0.27 of fp32, int4 0.14
_QMAX: Dict[str, float] = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}


def check_compress(compress: str) -> str:
    if compress not in COMPRESSIONS:
        raise UserError(f"compress={compress!r} is unknown: choose one of {', '.join(COMPRESSIONS)}")
    if compress == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise UserError(f"compress=fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} lacks: "
                        "use compress=int8 or a newer torch")
    return compress


class Codec:
    """One payload format; ``encode_``/``decode_`` work on whole blocks or a vector's tail."""

    def __init__(self, name: str) -> None:
        self.name = check_compress(name)
        if name == "none":
            raise ValueError("compress=none has no codec")
        self.qmax, self.half = _QMAX[name], name == "int4"
        self.block_bytes = 4 + (BLOCK // 2 if self.half else BLOCK)   # a whole block's scale and codes
        self._scratch: Dict[Tuple[str, torch.device], torch.Tensor] = {}

    def payload_bytes(self, numel: int) -> int:
        full, rest = divmod(numel, BLOCK)
        return full * self.block_bytes + (4 + ((rest + 1) // 2 if self.half else rest) if rest else 0)

    def values(self, a: int, b: int, numel: int) -> Tuple[int, int]:
        """Bytes [a, b) of a payload of ``numel`` values, cut at block boundaries -> its values."""
        lo = a // self.block_bytes * BLOCK
        return lo, (numel if b >= self.payload_bytes(numel) else b // self.block_bytes * BLOCK)

    def _buf(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        s = self._scratch.get((name, device))
        if s is None or s.numel() < numel * dtype.itemsize:
            s = self._scratch[(name, device)] = torch.empty(numel * dtype.itemsize, dtype=torch.uint8, device=device)
        return s[:numel * dtype.itemsize].view(dtype)

    # -- encoding ----------------------------------------------------------------------------
    def encode_(self, out: torch.Tensor, v: torch.Tensor, public: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``out`` (uint8, ``payload_bytes(v.numel())``) := the payload of ``v``, or with ``public``
        of ``v - public``, which then moves by the decoded payload (h <- h + Q(v - h))."""
        if public is not None:
            v = torch.sub(v, public, out=self._buf("change", v.numel(), torch.float32, v.device))
        full = v.numel() // BLOCK * BLOCK
        cut = full // BLOCK * self.block_bytes
        if full:
            self._blocks(out[:cut].view(-1, self.block_bytes), v[:full].view(-1, BLOCK),
                         None if public is None else public[:full].view(-1, BLOCK))
        if full < v.numel():   # the tail: one short block, coded as a whole one padded with zeros
            pad = torch.zeros(1, BLOCK, dtype=torch.float32, device=v.device)
            pad[0, :v.numel() - full] = v[full:]
            whole = torch.empty(1, self.block_bytes, dtype=torch.uint8, device=v.device)
            self._blocks(whole, pad, None)
            out[cut:].copy_(whole[0, :out.numel() - cut])
            if public is not None:
                self.decode_(public[full:], out[cut:], add=True)
        return out

    def _blocks(self, out: torch.Tensor, x: torch.Tensor, public: Optional[torch.Tensor]) -> None:
        """[nb, block_bytes] := the codes of [nb, BLOCK] fp32 values; ``public`` += what they decode to."""
        nb = x.shape[0]
        work = self._buf("work", x.numel(), torch.float32, x.device).view(nb, BLOCK)
        absmax = torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_())
        zero = absmax == 0
        scale = torch.where(zero, torch.ones_like(absmax), absmax / self.qmax)
        out[:, :4].copy_(scale.view(torch.uint8).view(nb, 4))
        torch.mul(x, torch.where(zero, torch.zeros_like(absmax), self.qmax / absmax)[:, None], out=work)
        codes = out[:, 4:]
        if self.name == "fp8":   # |work| <= qmax up to a rounding, which e4m3 (no infinity) must not see
            codes.view(torch.float8_e4m3fn).copy_(work.clamp_(-self.qmax, self.qmax))
            if public is not None:
                self._fp8(work, codes)
        elif self.name == "int8":
            codes.view(torch.int8).copy_(work.round_())
        else:   # int4: code + 8 in [1, 15], two to a byte
            nib = self._buf("nibbles", x.numel(), torch.uint8, x.device).view(nb, BLOCK // 2, 2)
            nib.view(torch.int8).view(nb, BLOCK).copy_(work.round_())
            nib.add_(8)   # -7..7 as bytes, wrapped: 1..15
            torch.bitwise_or(nib[..., 0], nib[..., 1].bitwise_left_shift(4), out=codes)
        if public is not None:   # what every receiver decodes: the code as fp32, times the scale
            public.add_(work.mul_(scale[:, None]))

    # -- decoding ----------------------------------------------------------------------------
    def decode_(self, out: torch.Tensor, payload: torch.Tensor, add: bool = False) -> torch.Tensor:
        """``out`` (fp32, the vector's length) := (or, with ``add``, += ) the values ``payload`` encodes."""
        full = out.numel() // BLOCK * BLOCK
        if full:
            self._unblocks(out[:full].view(-1, BLOCK), payload[:full // BLOCK * self.block_bytes].view(-1, self.block_bytes), add)
        if full < out.numel():
            whole = torch.zeros(self.block_bytes, dtype=torch.uint8, device=out.device)
            rest = payload[full // BLOCK * self.block_bytes:]
            whole[:rest.numel()] = rest
            vals = torch.zeros(BLOCK, dtype=torch.float32, device=out.device)
            self._unblocks(vals.view(1, BLOCK), whole.view(1, -1), False)
            tail = out[full:]
            tail.add_(vals[:tail.numel()]) if add else tail.copy_(vals[:tail.numel()])
        return out

    def _unblocks(self, out: torch.Tensor, payload: torch.Tensor, add: bool) -> None:
        nb = out.shape[0]
        scale = payload[:, :4].contiguous().view(torch.float32)   # [nb, 1]
        codes = payload[:, 4:]
        work = self._buf("work", out.numel(), torch.float32, out.device).view(nb, BLOCK) if add else out
        if self.name == "fp8":
            self._fp8(work, codes)
        elif self.name == "int8":
            work.copy_(codes.view(torch.int8))
        else:
            pairs, nib = work.view(nb, BLOCK // 2, 2), self._buf("nibbles", nb * BLOCK // 2, torch.uint8, out.device)
            pairs[..., 0].copy_(torch.bitwise_and(codes, 15, out=nib.view(nb, -1)))
            pairs[..., 1].copy_(torch.bitwise_right_shift(codes, 4, out=nib.view(nb, -1)))
            work.sub_(8)
        work.mul_(scale)
        if add:
            out.add_(work)


    def _fp8(self, work: torch.Tensor, codes: torch.Tensor) -> None:
        """[nb, BLOCK] fp32 := the e4m3 values of [nb, BLOCK] code bytes, by a table of all 256
        (the same values as torch's cast, 4x faster on CPU)."""
        table = self._scratch.get(("e4m3", work.device))
        if table is None:
            table = self._scratch[("e4m3", work.device)] = torch.arange(256, dtype=torch.uint8, device=work.device) \
                .view(torch.float8_e4m3fn).float()
        index = self._buf("index", codes.numel(), torch.int32, work.device)
        torch.index_select(table, 0, index.view(codes.shape).copy_(codes).view(-1), out=work.view(-1))


_CODECS: Dict[str, Codec] = {}


def codec(compress: str) -> Codec:
    """The one codec of each format in this process (it keeps scratch buffers)."""
    if compress not in _CODECS:
        _CODECS[compress] = Codec(compress)
    return _CODECS[compress]


def payload_bytes(numel: int, compress: str) -> int:
    """Bytes of one compressed vector of ``numel`` fp32 values (codes + scales); 4 per value for none."""
    return 4 * numel if compress == "none" else codec(compress).payload_bytes(numel)


def encode(v: torch.Tensor, compress: str) -> torch.Tensor:
    """The payload of ``v`` (fp32, 1-D), a new uint8 buffer of ``payload_bytes(v.numel(), compress)``."""
    out = torch.empty(payload_bytes(v.numel(), compress), dtype=torch.uint8, device=v.device)
    return codec(compress).encode_(out, v.float())


def decode_(out: torch.Tensor, payload: torch.Tensor, compress: str) -> torch.Tensor:
    """``out`` (fp32, 1-D, the vector's length) := the values ``payload`` encodes."""
    return codec(compress).decode_(out, payload)
