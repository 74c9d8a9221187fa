"""Compressed payloads: int8, fp8 (e4m3) or int4 codes with one fp32 scale per block of values,
or bf16 values (no scale).

A vector of P values is cut into blocks of :data:`BLOCK` (the last one shorter); each block gets
the scale ``absmax / qmax`` (qmax 127 for int8, 448 for e4m3, 7 for int4), and each value the code
``value * (qmax / absmax)`` rounded to the format (int8 and int4: to the nearest integer, halves to
even; fp8: to the nearest e4m3 value; int4 codes are stored biased by 8, two to a byte, the first
value in the low nibble). A payload is one ``uint8`` buffer, block after block, each block its
fp32 scale then its codes, so the meter and the wire count the scales too, and any cut at a block
boundary is a payload of its own: the transport encodes, sends and decodes a message piece by
piece (:meth:`Communicator.relay`). A payload decodes to the same fp32 values on every rank (codes
times scale, one multiplication per value), which is what lets every holder of a public copy keep
it bit-identical to the sender's, however the message was cut. ``bf16`` is the half-width
payload: each value rounded to the nearest bfloat16 (ties to even), 2 bytes, no scale, exactly
half the fp32 bytes; it decodes to fp32 exactly, so the same holds.

The compressor is deterministic and contractive (||v - Q(v)|| <= delta ||v||, delta < 1), the
class CHOCO-Gossip (Koloskova, Stich, Jaggi 2019) converges with. Compressing a vector itself
stalls at the quantization error; :mod:`admm_dist.engine.comm.compressed` therefore sends a
node's *change* against a public copy (h <- h + Q(v - h)), whose error vanishes as it settles.
A codec runs in place on the vector's device, into scratch buffers it keeps: one pass per step
of torch (absmax, multiply, round, cast; decode: cast, multiply), no float64 and no temporaries
of the whole vector. Those buffers make a codec an object with an owner: each consensus algorithm
makes its own (:func:`codec`); nothing here is shared between users.

The formats are registered in one place, :data:`FORMATS` (name -> :class:`Codec` subclass);
:data:`COMPRESSIONS` and :func:`check_compress`, and through them every ``compress`` option,
follow it.
"""
from __future__ import annotations

import abc
from typing import Dict, Optional, Tuple, Type

import torch

from admm_dist.core.errors import UserError

BLOCK = 64                        # values per fp32 scale: int8 costs (1 + 4/64) / 4 = 0.27 of fp32, int4 0.14


class Codec(abc.ABC):
    """One payload format: fp32 values <-> one ``uint8`` payload, cut into blocks of :attr:`block`
    values (:attr:`block_bytes` bytes each, the last block shorter); a cut at a block boundary is
    a payload of its own. ``encode_``/``decode_`` work on whole blocks or a vector's tail. An
    instance keeps scratch buffers: it belongs to one user."""

    name = ""                     # the ``compress`` value that picks it
    block = BLOCK                 # values per block
    block_bytes = 0               # a whole block's payload bytes

    def __init__(self) -> None:
        self._scratch: Dict[Tuple[str, torch.device], torch.Tensor] = {}

    @classmethod
    def unavailable(cls) -> Optional[str]:
        """Why this torch cannot run the format (None: it can)."""
        return None

    @abc.abstractmethod
    def payload_bytes(self, numel: int) -> int:
        """Bytes of the payload of ``numel`` values."""

    def values(self, a: int, b: int, numel: int) -> Tuple[int, int]:
        """Bytes [a, b) of a payload of ``numel`` values, cut at block boundaries -> its values."""
        lo = a // self.block_bytes * self.block
        return lo, (numel if b >= self.payload_bytes(numel) else b // self.block_bytes * self.block)

    @abc.abstractmethod
    def encode_(self, out: torch.Tensor, v: torch.Tensor,
                public: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``out`` (uint8, ``payload_bytes(v.numel())``) := the payload of ``v``, or with ``public``
        of ``v - public``, which then moves by the decoded payload (h <- h + Q(v - h))."""

    @abc.abstractmethod
    def decode_(self, out: torch.Tensor, payload: torch.Tensor, add: bool = False) -> torch.Tensor:
        """``out`` (fp32, the vector's length) := (or, with ``add``, += ) the values ``payload`` encodes."""

    def _buf(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        s = self._scratch.get((name, device))
        if s is None or s.numel() < numel * dtype.itemsize:
            s = self._scratch[(name, device)] = torch.empty(numel * dtype.itemsize, dtype=torch.uint8,
                                                            device=device)
        return s[:numel * dtype.itemsize].view(dtype)


class ScaledCodec(Codec):
    """Codes with one fp32 scale (``absmax / qmax``) per block: a block is its scale, then its
    codes. A subclass says how values in code units become codes and back."""

    qmax = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.block_bytes = 4 + self._code_bytes(BLOCK)   # a whole block's scale and codes

    def _code_bytes(self, numel: int) -> int:
        """Bytes of the codes of ``numel`` values."""
        return numel

    @abc.abstractmethod
    def _code(self, codes: torch.Tensor, work: torch.Tensor, public: bool) -> None:
        """[nb, code bytes] := the codes of [nb, BLOCK] values in code units (|work| <= qmax, up
        to a rounding); with ``public``, ``work`` is left holding what the codes decode to."""

    @abc.abstractmethod
    def _uncode(self, work: torch.Tensor, codes: torch.Tensor) -> None:
        """[nb, BLOCK] fp32 := what [nb, code bytes] codes decode to, in code units."""

    def payload_bytes(self, numel: int) -> int:
        full, rest = divmod(numel, BLOCK)
        return full * self.block_bytes + (4 + self._code_bytes(rest) if rest else 0)

    # -- encoding ----------------------------------------------------------------------------
    def encode_(self, out: torch.Tensor, v: torch.Tensor,
                public: Optional[torch.Tensor] = None) -> torch.Tensor:
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
        self._code(out[:, 4:], work, public is not None)
        if public is not None:   # what every receiver decodes: the code as fp32, times the scale
            public.add_(work.mul_(scale[:, None]))

    # -- decoding ----------------------------------------------------------------------------
    def decode_(self, out: torch.Tensor, payload: torch.Tensor, add: bool = False) -> torch.Tensor:
        full = out.numel() // BLOCK * BLOCK
        if full:
            self._unblocks(out[:full].view(-1, BLOCK),
                           payload[:full // BLOCK * self.block_bytes].view(-1, self.block_bytes), add)
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
        work = self._buf("work", out.numel(), torch.float32, out.device).view(nb, BLOCK) if add else out
        self._uncode(work, payload[:, 4:])
        work.mul_(scale)
        if add:
            out.add_(work)


class Int8Codec(ScaledCodec):
    """int8 codes: a value in code units rounded to the nearest integer, halves to even."""

    name, qmax = "int8", 127.0

    def _code(self, codes: torch.Tensor, work: torch.Tensor, public: bool) -> None:
        codes.view(torch.int8).copy_(work.round_())

    def _uncode(self, work: torch.Tensor, codes: torch.Tensor) -> None:
        work.copy_(codes.view(torch.int8))


class Fp8Codec(ScaledCodec):
    """fp8 (e4m3) codes: a value in code units rounded to the nearest e4m3 value."""

    name, qmax = "fp8", 448.0

    @classmethod
    def unavailable(cls) -> Optional[str]:
        if hasattr(torch, "float8_e4m3fn"):
            return None
        return (f"compress=fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} lacks: "
                "use compress=int8 or a newer torch")

    def _code(self, codes: torch.Tensor, work: torch.Tensor, public: bool) -> None:
        # |work| <= qmax up to a rounding, which e4m3 (no infinity) must not see
        codes.view(torch.float8_e4m3fn).copy_(work.clamp_(-self.qmax, self.qmax))
        if public:
            self._uncode(work, codes)

    def _uncode(self, work: torch.Tensor, codes: torch.Tensor) -> None:
        """The e4m3 values of the code bytes, by a table of all 256 (the same values as torch's
        cast, 4x faster on CPU)."""
        table = self._scratch.get(("e4m3", work.device))
        if table is None:
            table = self._scratch[("e4m3", work.device)] = \
                torch.arange(256, dtype=torch.uint8, device=work.device).view(torch.float8_e4m3fn).float()
        index = self._buf("index", codes.numel(), torch.int32, work.device)
        torch.index_select(table, 0, index.view(codes.shape).copy_(codes).view(-1), out=work.view(-1))


class Int4Codec(ScaledCodec):
    """int4 codes: rounded as int8's, stored biased by 8 (1..15), two to a byte, the first value
    in the low nibble."""

    name, qmax = "int4", 7.0

    def _code_bytes(self, numel: int) -> int:
        return (numel + 1) // 2

    def _code(self, codes: torch.Tensor, work: torch.Tensor, public: bool) -> None:
        nb = work.shape[0]
        nib = self._buf("nibbles", work.numel(), torch.uint8, work.device).view(nb, BLOCK // 2, 2)
        nib.view(torch.int8).view(nb, BLOCK).copy_(work.round_())
        nib.add_(8)   # -7..7 as bytes, wrapped: 1..15
        torch.bitwise_or(nib[..., 0], nib[..., 1].bitwise_left_shift(4), out=codes)

    def _uncode(self, work: torch.Tensor, codes: torch.Tensor) -> None:
        nb = work.shape[0]
        pairs = work.view(nb, BLOCK // 2, 2)
        nib = self._buf("nibbles", nb * BLOCK // 2, torch.uint8, work.device)
        pairs[..., 0].copy_(torch.bitwise_and(codes, 15, out=nib.view(nb, -1)))
        pairs[..., 1].copy_(torch.bitwise_right_shift(codes, 4, out=nib.view(nb, -1)))
        work.sub_(8)


class Bf16Codec(Codec):
    """bfloat16 values: each rounded to the nearest bf16 (ties to even), 2 bytes, no scale. A
    block is :data:`BLOCK` values (where a message is cut), nothing more."""

    name, block_bytes = "bf16", 2 * BLOCK

    def payload_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode_(self, out: torch.Tensor, v: torch.Tensor,
                public: Optional[torch.Tensor] = None) -> torch.Tensor:
        if public is not None:
            v = torch.sub(v, public, out=self._buf("change", v.numel(), torch.float32, v.device))
        codes = out.view(torch.bfloat16)
        codes.copy_(v)   # round to nearest, ties to even
        if public is not None:   # what every receiver decodes: the bf16 value as fp32
            public.add_(self._buf("work", v.numel(), torch.float32, v.device).copy_(codes))
        return out

    def decode_(self, out: torch.Tensor, payload: torch.Tensor, add: bool = False) -> torch.Tensor:
        codes = payload.view(torch.bfloat16)
        if add:
            out.add_(self._buf("work", out.numel(), torch.float32, out.device).copy_(codes))
        else:
            out.copy_(codes)
        return out


# The payload formats, by the name ``compress`` gives them: the one place a format is added.
FORMATS: Dict[str, Type[Codec]] = {c.name: c for c in (Int8Codec, Fp8Codec, Int4Codec, Bf16Codec)}
COMPRESSIONS: Tuple[str, ...] = ("none", *FORMATS)


def check_compress(compress: str) -> str:
    if compress not in COMPRESSIONS:
        raise UserError(f"compress={compress!r} is unknown: choose one of {', '.join(COMPRESSIONS)}")
    why = FORMATS[compress].unavailable() if compress in FORMATS else None
    if why:
        raise UserError(why)
    return compress


def codec(compress: str) -> Codec:
    """A new codec of format ``compress``, for one user (it keeps scratch buffers)."""
    if check_compress(compress) == "none":
        raise ValueError("compress=none has no codec")
    return FORMATS[compress]()


def payload_bytes(numel: int, compress: str) -> int:
    """Bytes of one compressed vector of ``numel`` fp32 values (codes + scales); 4 per value for none."""
    return 4 * numel if compress == "none" else codec(compress).payload_bytes(numel)


def encode(v: torch.Tensor, compress: str) -> torch.Tensor:
    """The payload of ``v`` (fp32, 1-D), a new uint8 buffer of ``payload_bytes(v.numel(), compress)``."""
    cod = codec(compress)
    out = torch.empty(cod.payload_bytes(v.numel()), dtype=torch.uint8, device=v.device)
    return cod.encode_(out, v.float())


def decode_(out: torch.Tensor, payload: torch.Tensor, compress: str) -> torch.Tensor:
    """``out`` (fp32, 1-D, the vector's length) := the values ``payload`` encodes."""
    return codec(compress).decode_(out, payload)
