"""Per-node checkpoints that resume bit for bit.

Layout, under ``<out>.ckpt/``::

    round-000012/node-3.safetensors   x, z, u, Adam moments, torch RNG state(s)
    round-000012/node-3.json          round, config fingerprint, the engine's round, rho and
                                      history, Adam step, sampler state, the run's record,
                                      the settings that may change on resume, and the
                                      sha256 of both files

Each file is written atomically (temporary file, fsync, rename) and the JSON
file is written last: its presence marks the node's checkpoint of that round
as complete. Loading verifies both checksums and the layout, so a flipped bit or a
hand-edited file is refused, naming the file, instead of resuming to a different result.
Every JSON file carries the run's fingerprint (its semantic settings and
the content of its fit set and initial state): a round counts for a run only when every
node's file carries that run's fingerprint, so one run never resumes from, or prunes,
another's checkpoints. ``resume auto`` restarts from the last round that *every* node
completed, agreed across ranks (:mod:`admm_dist.engine.control`); only the last ``keep`` rounds
that every rank has completed are kept (a rank never prunes a round another rank still needs).
Nothing is pickled.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from admm_dist.core.errors import UserError
from admm_dist.core.io import atomic_write_bytes, atomic_write_json, own_folder

_ROUND_DIR = re.compile(r"^round-(\d{6})$")
MAX_MARKER_BYTES = 64 << 20   # a marker holds the history and dev curve: kilobytes; more is not ours


class CheckpointError(UserError):
    """A checkpoint is missing, corrupt, or from another configuration."""


def ckpt_root(out: str) -> str:
    return out.rstrip("/") + ".ckpt"


def round_dir(root: str, k: int) -> str:
    return os.path.join(root, f"round-{k:06d}")


def _meta_digest(meta: Mapping[str, object]) -> str:
    """sha256 of a checkpoint JSON's content without its own ``meta_sha256`` (canonical form)."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def save_node(root: str, k: int, node: int, tensors: Mapping[str, torch.Tensor],
              meta: Mapping[str, object]) -> None:
    """Write node ``node``'s checkpoint of round ``k``: tensors first, then the JSON marker that
    carries both files' sha256. Each is a temporary written then renamed
    (:func:`~admm_dist.core.io.atomic_write_bytes`)."""
    folder = own_folder(round_dir(own_folder(root, "the checkpoint folder"), k), "the checkpoint folder")
    remove_orphans(folder, [node])
    data = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    blob = st_save(data)
    atomic_write_bytes(os.path.join(folder, f"node-{node}.safetensors"), blob)
    record = dict(meta, round=k, node=node, tensors_sha256=hashlib.sha256(blob).hexdigest())
    record["meta_sha256"] = _meta_digest(record)
    atomic_write_json(os.path.join(folder, f"node-{node}.json"), record)


def all_rounds(root: str) -> List[int]:
    """Every round folder under ``root`` (whoever wrote it, complete or not), ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_ROUND_DIR.match, os.listdir(root)) if m)


def read_marker(path: str) -> Optional[dict]:
    """The JSON object of a node marker, or None (missing, unreadable, not an object)."""
    try:
        with open(path, "rb") as fh:
            meta = json.loads(fh.read(MAX_MARKER_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def _fingerprint_of(path: str) -> Optional[str]:
    fp = (read_marker(path) or {}).get("fingerprint")
    return fp if isinstance(fp, str) else None


def marker_fits(meta: Mapping[str, object], k: int, node: int) -> bool:
    """Whether a marker names the round and node of the folder and file it sits in: a pair
    copied or moved from another round is intact, but it is not this round's."""
    return type(meta.get("round")) is int and type(meta.get("node")) is int \
        and meta["round"] == k and meta["node"] == node


def completed_rounds(root: str, nodes: Sequence[int], fingerprint: Optional[str] = None) -> List[int]:
    """Rounds for which every node in ``nodes`` has a complete checkpoint, ascending; with
    ``fingerprint``, only those written by that run. A marker that names another round or node
    than its place does not count (resume falls back to the round before)."""
    out = []
    for k in all_rounds(root):
        metas = [read_marker(os.path.join(round_dir(root, k), f"node-{n}.json")) for n in nodes]
        if not all(m is not None and marker_fits(m, k, n) for m, n in zip(metas, nodes)):
            continue
        if fingerprint is None or all(m.get("fingerprint") == fingerprint for m in metas):
            out.append(k)
    return out


def misplaced(root: str, nodes: Sequence[int]) -> List[str]:
    """This process's node markers that name another round or node than their place."""
    out = []
    for k in all_rounds(root):
        for n in nodes:
            path = os.path.join(round_dir(root, k), f"node-{n}.json")
            meta = read_marker(path)
            if meta is not None and not marker_fits(meta, k, n):
                out.append(path)
    return out


def foreign_rounds(root: str, fingerprint: str) -> List[int]:
    """Rounds holding a node marker (of any node) that names another run's fingerprint."""
    out = []
    for k in all_rounds(root):
        folder = round_dir(root, k)
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        marks = [n for n in names if n.startswith("node-") and n.endswith(".json")]
        if any(_fingerprint_of(os.path.join(folder, n)) != fingerprint for n in marks):
            out.append(k)
    return out


def previous_of(root: str, k: int, node: int) -> int:
    """The checkpoint round that node ``node``'s round ``k`` followed (0: the first, or unknown)."""
    prev = (read_marker(os.path.join(round_dir(root, k), f"node-{node}.json")) or {}).get("previous", 0)
    return prev if isinstance(prev, int) and not isinstance(prev, bool) else 0


# What a checkpoint must hold: tensor name -> dtype (None: any float), and JSON key -> type(s).
TENSORS = {"x": None, "z": None, "u": None, "rng_cpu": torch.uint8}
META = {"fingerprint": str, "engine": dict, "adam": dict, "sampler": (dict, type(None)), "record": dict,
        "best": (dict, type(None)), "round": int, "node": int, "resumable": dict, "identity": dict,
        "previous": int}
# the engine's state_dict() beside its tensors
ENGINE_META = {"round": int, "rho": (int, float), "history": list}
RECORD_META = {"collections": list, "anchor_keys_all": list, "dev_curve": list}   # RunRecord.state_dict()


def _check_layout(where: str, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object]) -> None:
    for name, dtype in TENSORS.items():
        t = tensors.get(name)
        if (t is None or (dtype is not None and t.dtype != dtype)
                or (dtype is None and not t.is_floating_point())):
            raise CheckpointError(f"checkpoint {where} lacks a valid tensor {name!r}: the file is damaged "
                                  "or from another version; delete that round folder to resume "
                                  "from the one before")
    for part, layout in ((meta, META), (meta.get("engine"), ENGINE_META), (meta.get("record"), RECORD_META)):
        for key, types in layout.items():
            if key not in part or not isinstance(part[key], types) or isinstance(part[key], bool):
                raise CheckpointError(f"checkpoint {where} lacks a valid {key!r} (found "
                                      f"{type(part.get(key)).__name__}): the file is damaged or from another "
                                      "version; delete that round folder to resume from the one before")
    best = meta["best"]
    if best is not None and ("best_z" not in tensors or set(best) != {"dev_nll", "round"}):
        raise CheckpointError(f"checkpoint {where} names a best round but lacks its tensor: delete that "
                              "round folder to resume from the one before")


def load_node(root: str, k: int, node: int, fingerprint: str) -> Tuple[Dict[str, torch.Tensor], Dict]:
    """Node ``node``'s checkpoint of round ``k``, verified: both checksums, the fingerprint and the
    layout. Any problem is a :class:`CheckpointError` naming the file and the fix."""
    folder = round_dir(root, k)
    jpath = os.path.join(folder, f"node-{node}.json")
    tpath = os.path.join(folder, f"node-{node}.safetensors")
    damaged = "delete that round folder to resume from the one before"
    try:
        with open(jpath, "rb") as fh:
            meta = json.loads(fh.read().decode("utf-8"))
        with open(tpath, "rb") as fh:
            blob = fh.read()
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint of node {node} at round {k} is missing ({e.filename}): "
                              "start without resume=auto or choose another out=") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {jpath} is not valid JSON ({type(e).__name__}): "
                              f"{damaged}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {jpath} is not a JSON object: {damaged}")
    if not marker_fits(meta, k, node):
        raise CheckpointError(f"checkpoint {jpath} names round {meta.get('round')!r}, "
                              f"node {meta.get('node')!r}, not round {k}, node {node}: it was copied from "
                              f"another place; {damaged}")
    if meta.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {folder} was written by another configuration (fingerprint "
            f"{meta.get('fingerprint')} != {fingerprint}): resume with the same settings, "
            "or use a new out=")
    if meta.get("meta_sha256") != _meta_digest(meta):
        raise CheckpointError(f"checkpoint {jpath} fails its checksum (its content changed after it was "
                              f"written): {damaged}")
    if meta.get("tensors_sha256") != hashlib.sha256(blob).hexdigest():
        raise CheckpointError(f"checkpoint {tpath} fails its checksum (sha256 differs from the one in "
                              f"node-{node}.json): {damaged}")
    try:
        tensors = st_load(blob)
    except Exception as e:   # safetensors raises its own types for a damaged header
        raise CheckpointError(f"checkpoint {tpath} is not a readable safetensors file "
                              f"({type(e).__name__}): {damaged}") from None
    _check_layout(f"{folder}/node-{node}", tensors, meta)
    return tensors, meta


def remove_orphans(folder: str, nodes: Sequence[int]) -> None:
    """Remove the temporaries a killed write of ``nodes``' files left in ``folder`` (only these
    nodes': another rank may be writing its own right now)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    mine = tuple(f".node-{n}.{ext}." for n in nodes for ext in ("json", "safetensors"))
    for name in names:
        if name.endswith(".tmp") and name.startswith(mine):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


def prune(root: str, nodes: Sequence[int], keep: int, fingerprint: str, *, upto: int) -> None:
    """Delete this process's node files from this run's complete rounds older than the newest
    ``keep`` of those up to ``upto``, the newest round *every* rank has completed (the caller
    agrees it across ranks): a round another rank may still need is never pruned. Other runs'
    files are never touched; temporaries of a killed write go with their round."""
    rounds = [k for k in completed_rounds(root, nodes, fingerprint) if k <= upto]
    for k in rounds[:-keep] if keep > 0 else []:
        folder = round_dir(root, k)
        for n in nodes:
            for ext in (".json", ".safetensors"):  # marker first: an unmarked round is never used
                p = os.path.join(folder, f"node-{n}{ext}")
                if os.path.exists(p):
                    os.unlink(p)
        remove_orphans(folder, nodes)
        try:
            os.rmdir(folder)  # succeeds once every node's files are gone
        except OSError:
            pass


def remove_all(root: str) -> None:
    if os.path.isdir(root):
        shutil.rmtree(root, ignore_errors=True)
