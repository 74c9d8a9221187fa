"""The frozen backbone sharded over a seat group with FSDP2 (``shard_backbone=true``).

Loading: no rank ever holds the whole backbone. The weights files are those transformers reads
(:class:`WeightFiles`: the folder's ``model.safetensors``, else the files its
``model.safetensors.index.json`` names, never any other file), each checked by the safetensors
library itself. The model is first built on the meta device only to compare every parameter's
shape with its file's, so that a ``config.json`` that does not match its weights is refused
before any memory is asked for. It is then built again with accelerate's ``init_empty_weights``
(parameters take no memory, buffers such as the rotary frequencies are real). Then, over the
seat group's ranks (the 1-D ``shard`` mesh of :class:`~admm_dist.engine.dist.RankMesh`), each
decoder layer becomes one ``fully_shard`` group; the decoder's embedding and final norm with the
output head (tied or not) one more, a group of two modules, because the objectives run the decoder
and then the head on the scored positions only (:func:`admm_dist.model.objectives.token_logps`);
and the causal LM the root, run once on one token so that FSDP2 takes it as the root. Only then is
memory allocated: each rank's shard of each weight, rows ``[r * ceil(n / k), ...)`` of dim 0, read
from the files through the library's slices (:meth:`WeightFiles.read_rows`). A slice is a view
of the file's memory map, so a rank touches only the pages of its own rows; they are
file-backed pages of the page cache (counted in the resident set while the file is open, and
released when it is closed, after each tensor), and what a rank keeps is its copy of its rows.
Host RAM for the weights is then about 1/k of the backbone per rank (measured by
``python -m benchmarks.placement``). As with the unsharded loader (the same library), a
weights file cut short by another process while it is being read ends the process (SIGBUS).

Running: FSDP2 all-gathers a layer's weights just before the layer runs and frees them
after. The gathered weights are the file's values, so every forward and backward computes the
same bits as the unsharded model (on CPU; on GPU where the kernels are deterministic).

The LoRA layers are added afterwards, outside FSDP's groups: the B vector the engine works on
stays whole on every rank of the group (each rank's B weights are views into its one flat
vector, :class:`~admm_dist.model.adapter.BOnlyLoRA`), and every rank of a seat runs the same
Adam step on the same summed gradient (:mod:`admm_dist.engine.seat_group`). The random basis
A stays whole too: it is small, and its hash checks every rank's basis. Whatever reads a whole
frozen weight (the backbone's digest, ||W||^2 for ``delta_w_rel``) gathers it, one tensor at a
time, while the adapter is built, on every rank of the group in the same order.

Every rank of the group must then run the same number of forwards at the same time. The
trainer's x-steps (M / k parts each), reference log-probs and held-out NLL do.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import struct
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
from safetensors import SafetensorError, deserialize, safe_open

from admm_dist.core.errors import UserError, one_line
from admm_dist.core.io import check_model_files

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or the whole tensor a sharded parameter is a shard of (a collective over its
    group: every rank of the group must call it for the same tensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}

SINGLE = "model.safetensors"               # transformers' names for a model's weights
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 * 2 ** 20   # bytes of a safetensors header, at most (the format's own bound)
MAX_INDEX = 100 * 2 ** 20    # bytes of an index, at most (a model of 10^5 tensors needs about 10 MiB)


class WeightFiles:
    """The tensors of a model folder's weights files (:func:`weight_files`), read a range of rows
    at a time. Each file is opened with the safetensors library, which checks its header (the
    entries' fields, each byte range inside the data and matching its shape and dtype, the ranges
    following one another): what the library refuses is one :class:`UserError` naming the file
    and, where it can be known, the tensor. A name held by two files, or an index that puts a
    tensor in a file that does not hold it, is refused too: which file counts is then not clear.

    ``tensors`` maps each name to its file, dtype and shape."""

    def __init__(self, folder: str) -> None:
        check_model_files(folder, "shard_backbone:")
        self.tensors: Dict[str, Tuple[str, torch.dtype, Tuple[int, ...]]] = {}
        names, weight_map = weight_files(folder)
        for file in names:
            path = os.path.join(folder, file)
            with _opened(path) as fh:
                for name in fh.keys():
                    if name in self.tensors:
                        raise UserError(f"shard_backbone: {_shown(name)} is held by both "
                                        f"{os.path.basename(self.tensors[name][0])} and {file}, files of "
                                        f"{os.path.join(folder, INDEX)}: which one counts is not clear; "
                                        f"download the model again")
                    rows = fh.get_slice(name)
                    dtype = rows.get_dtype()
                    if dtype not in _DTYPES:
                        raise UserError(f"shard_backbone: {path} holds {_shown(name)} as {_shown(dtype)}, "
                                        f"which this loader does not read: drop shard_backbone=true")
                    self.tensors[name] = (path, _DTYPES[dtype], tuple(rows.get_shape()))
        for name, file in (weight_map or {}).items():
            held = os.path.basename(self.tensors[name][0]) if name in self.tensors else None
            if held != file:
                raise UserError(f"shard_backbone: {os.path.join(folder, INDEX)} puts {_shown(name)} "
                                f"in {file}, which does not hold it{f' ({held} does)' if held else ''}: "
                                f"download the model again")

    def read_rows(self, name: str, start: int, out: torch.Tensor) -> None:
        """Rows ``start .. start + len(out)`` of tensor ``name`` (dim 0; a 0-d tensor whole) into
        ``out``, cast to its dtype. The file is opened for this tensor only (its header checked
        again): the slice is a view of its memory map, whose pages go when both are closed."""
        path, _, shape = self.tensors[name]
        with _opened(path) as fh:
            rows = fh.get_slice(name)[start:start + out.shape[0]] if shape else fh.get_tensor(name)
            out.copy_(rows)
            del rows            # the last view of the map: it goes when the file is closed


def weight_files(folder: str) -> Tuple[List[str], Optional[Dict[str, str]]]:
    """The weights files of ``folder`` that transformers reads, with the index's map of tensor
    name -> file name when there is one: its ``model.safetensors`` when it has one, else the
    files its ``model.safetensors.index.json`` names, else none. No other file is read: a stray
    ``old.safetensors`` beside them is not the model's. An index must be a JSON object of at most
    :data:`MAX_INDEX` bytes whose ``weight_map`` maps names to plain file names of the folder."""
    if os.path.isfile(os.path.join(folder, SINGLE)):
        return [SINGLE], None
    index = os.path.join(folder, INDEX)
    if not os.path.isfile(index):
        return [], None
    with open(index, "rb") as fh:
        raw = fh.read(MAX_INDEX + 1)
    if len(raw) > MAX_INDEX:
        raise UserError(f"shard_backbone: {index} is larger than {MAX_INDEX} bytes, the ceiling of an index: "
                        f"download the model again")
    try:
        weight_map = json.loads(raw.decode("utf-8")).get("weight_map")
    except (ValueError, AttributeError, RecursionError) as exc:   # not JSON or UTF-8, not an object, too deep
        raise UserError(f"shard_backbone: {index} is not a JSON object ({type(exc).__name__}: "
                        f"{_shown(one_line(exc))}): download the model again") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"shard_backbone: {index} has no weight_map of tensor names to file names: "
                        f"download the model again")
    files = sorted(set(weight_map.values()))
    for file in files:
        if not file.isprintable() or file in ("", ".", "..") or file != os.path.basename(file):
            raise UserError(f"shard_backbone: {index} names the file {_shown(file, quote=True)}, which is "
                            f"not a plain file name inside the model folder: download the model again")
        if not os.path.isfile(os.path.join(folder, file)):
            raise UserError(f"shard_backbone: {index} names {file}, which is not a file of {folder}: "
                            f"download the model again")
    return files, weight_map


@contextlib.contextmanager
def _opened(path: str):
    """``safe_open(path)``, the library's refusal of it one :class:`UserError` (:func:`_refusal`)."""
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as exc:
        raise _refusal(path, exc) from None
    with handle as fh:
        yield fh


def _refusal(path: str, exc: Exception) -> UserError:
    """The library's refusal of ``path`` as one line naming the file and, where it can be known,
    the tensor and its entry in the header (:func:`_culprit`)."""
    if isinstance(exc, OSError):
        return UserError(f"shard_backbone: {path} cannot be read ({_shown(exc.strerror or one_line(exc))}): "
                         f"download it again")
    reason = _reason(one_line(exc))
    named = re.search(r"for tensor `(.*)`", one_line(exc))
    header = _header(path)
    name = named.group(1) if named and header and named.group(1) in header else None
    if name is None and header is not None:
        name, reason = _culprit(header) or (None, reason)
    where = "" if name is None else f"{'entry' if name == '__metadata__' else 'tensor'} {_shown(name)}: "
    entry = "" if name is None else f"; its entry: {_shown(json.dumps(header[name]))}"
    return UserError(f"shard_backbone: {path} is not a valid safetensors file ({where}{reason}{entry}): "
                     f"download it again")


def _header(path: str) -> Optional[dict]:
    """The JSON table at the head of ``path`` (8 bytes of little-endian length, then the table),
    for messages only: None if it cannot be read within :data:`MAX_HEADER` bytes, or is not an
    object."""
    try:
        with open(path, "rb") as fh:
            size = struct.unpack("<Q", fh.read(8).ljust(8, b"\xff"))[0]
            table = json.loads(fh.read(size).decode("utf-8")) if size <= MAX_HEADER else None
    except (OSError, ValueError, RecursionError):    # RecursionError: nested past json's depth
        return None
    return table if isinstance(table, dict) else None


def _culprit(header: dict) -> Optional[Tuple[str, str]]:
    """The first entry of ``header`` that the library refuses on its own, and its reason; None if
    every entry passes alone. Each entry is put alone in a header with no data (its byte range
    moved to start at 0) and given to the library: what it says of a sound entry alone (its data
    is missing) is learnt from an entry known to be sound, so that no wording is assumed."""
    def alone(name: str, entry) -> Optional[str]:
        if isinstance(entry, dict) and _offsets(entry.get("data_offsets")):
            start, end = entry["data_offsets"]
            entry = dict(entry, data_offsets=[0, end - start])
        table = json.dumps({name: entry}).encode()
        try:
            deserialize(struct.pack("<Q", len(table)) + table)
        except SafetensorError as exc:
            return one_line(exc)
        return None

    sound = alone("sound", {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]})
    for name, entry in header.items():
        said = alone(name, entry)
        if said is not None and said != sound:
            return name, _reason(said)
    return None


def _offsets(offsets) -> bool:
    """Whether ``offsets`` is a pair of integers, the second not below the first (an entry whose
    range :func:`_culprit` may move to 0: any other is refused by the library as it is)."""
    return (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1])


def _reason(said: str) -> str:
    """The library's message without its prefix, the tensor it names (said apart) and its
    position in the JSON (a probe's position is not the file's)."""
    said = re.sub(r"^Error while deserializing( header)?: (invalid JSON in header: )?", "", said)
    said = re.sub(r" at line \d+ column \d+$", "", said)
    return _shown(re.sub(r" for tensor( `.*`)?$", "", said), limit=160)


def _shown(text: str, limit: int = 120, quote: bool = False) -> str:
    """``text`` for a one-line message: as a Python literal if it holds a control character (or
    ``quote``), cut to ``limit`` characters."""
    text = ascii(text) if quote or not text.isprintable() else text
    return text if len(text) <= limit else text[:limit] + "..."


def _local_folder(src: str) -> str:
    """A hub id's snapshot (config, tokenizer and safetensors files only), or ``src`` itself."""
    if os.path.isdir(src):
        return src
    from huggingface_hub import snapshot_download

    return snapshot_download(src, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"])


def load_sharded(src: str, device: torch.device, mesh: "DeviceMesh", dtype: torch.dtype):
    """The causal LM of ``src`` with its weights sharded over ``mesh`` (1-D: the ranks of one seat,
    :attr:`admm_dist.engine.dist.RankMesh.shard`), each rank reading only its own rows from the
    safetensors files."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = _local_folder(src)
    files = WeightFiles(folder)
    if not files.tensors:
        raise UserError(f"shard_backbone: {src} has no safetensors weights to read shard by shard: "
                        f"convert the model to safetensors (save_pretrained) or drop shard_backbone=true")
    _return_freed_memory()
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    check_shapes(config, files, folder)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shard_groups(model, mesh)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)          # allocates each rank's shards only
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            files.read_rows(name, first_row(p), local)
    run_root(model, device)
    return model.eval()


def shard_groups(model, mesh: "DeviceMesh") -> None:
    """Make ``model`` (built without memory) FSDP2's: one group per decoder layer, the embedding
    with the final norm and the output head one more, the causal LM the root. Also what a
    rehearsal of the job shards (:mod:`admm_dist.training.rehearsal`)."""
    from torch.distributed.fsdp import fully_shard

    model.tie_weights()                    # a tied head is the embedding's parameter, held once
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([decoder, head] if head is not None else decoder, mesh=mesh)
    fully_shard(model, mesh=mesh)          # the root: no parameters of its own


def run_root(model, device) -> None:
    """FSDP2 takes its root to be the first module run: run the sharded model once, on one token."""
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)


def check_shapes(config, files: WeightFiles, folder: str) -> None:
    """Refuse, before any memory is asked for, a model whose ``config.json`` gives a parameter a
    shape other than its file's (a vocab_size of 10^12 would otherwise be allocated first), or
    one that no file holds. The model is built on the meta device for its shapes only: there
    even a buffer takes no memory, whereas ``init_empty_weights`` creates each parameter on the
    CPU before it moves it to the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    for name, p in model.named_parameters():
        if name not in files.tensors:
            raise UserError(f"shard_backbone: {folder} has no tensor {name}: load this model unsharded "
                            f"(drop shard_backbone=true)")
        path, _, shape = files.tensors[name]
        if shape != tuple(p.shape):
            raise UserError(f"shard_backbone: {name} is {list(p.shape)} by "
                            f"{os.path.join(folder, 'config.json')} but {list(shape)} in {path}: the config "
                            f"does not match the weights (nothing was allocated); download the model again")


def first_row(p: torch.Tensor) -> int:
    """The first row of dim 0 that this rank holds of ``p``: FSDP2 shards a parameter's dim 0 as
    its DTensor placement ``Shard(0)`` says (torch.chunk's rule), so the offset is that placement's."""
    if not hasattr(p, "placements") or p.dim() == 0:
        return 0
    shard, mesh = p.placements[0], p.device_mesh
    _, offset = shard.local_shard_size_and_offset(p.shape[shard.dim], mesh.size(0), mesh.get_local_rank(0))
    return int(offset)


def _return_freed_memory() -> None:
    """Have glibc hand freed blocks of 1 MiB and more straight back to the system. FSDP2 gathers
    a layer's weights and frees them at every forward; glibc's mmap threshold otherwise rises
    to the size of such a block, keeps the freed gathers on its heap, and the resident set grows
    to hold a whole backbone's worth of them (measured: SmolLM2 at k = 4, 536 MiB after loading,
    914-1469 MiB after one forward; 558-567 MiB with this). Nothing happens without glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 20)   # M_MMAP_THRESHOLD: fixed, no longer dynamic
    except (OSError, AttributeError):
        pass


def held_bytes(model: torch.nn.Module) -> Tuple[int, int]:
    """(backbone, adapter): bytes of the parameters this rank holds, the frozen backbone's (a
    sharded weight's local shard) and the LoRA weights' (whole on every rank)."""
    held = [0, 0]
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        held["lora_" in name] += local.numel() * local.element_size()
    return held[0], held[1]
