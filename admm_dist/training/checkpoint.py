"""Per-node checkpoints that resume bit for bit.

Layout, under ``<out>.ckpt/``::

    round-000012/node-3.safetensors   x, z, u, Adam moments, torch RNG state(s)
    round-000012/node-3.json          round, config fingerprint, Adam step, sampler
                                      state, Python RNG state, telemetry so far

Each file is written atomically (temporary file, fsync, rename) and the JSON
file is written last: its presence marks the node's checkpoint of that round
as complete. Every JSON file carries the run's fingerprint (its semantic settings and
the content of its fit set and initial state): a round counts for a run only when every
node's file carries that run's fingerprint, so one run never resumes from, or prunes,
another's checkpoints. ``resume auto`` restarts from the last round that *every* node
completed, agreed across ranks through the communicator; only the last ``keep`` rounds
are kept. Nothing is pickled.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from admm_dist.core.errors import UserError
from admm_dist.core.io import atomic_write_bytes, atomic_write_json

_ROUND_DIR = re.compile(r"^round-(\d{6})$")


class CheckpointError(UserError):
    """A checkpoint is missing, corrupt, or from another configuration."""


def ckpt_root(out: str) -> str:
    return out.rstrip("/") + ".ckpt"


def round_dir(root: str, k: int) -> str:
    return os.path.join(root, f"round-{k:06d}")


def save_node(root: str, k: int, node: int, tensors: Mapping[str, torch.Tensor],
              meta: Mapping[str, object]) -> None:
    folder = round_dir(root, k)
    data = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    atomic_write_bytes(os.path.join(folder, f"node-{node}.safetensors"), st_save(data))
    atomic_write_json(os.path.join(folder, f"node-{node}.json"), dict(meta, round=k, node=node))


def all_rounds(root: str) -> List[int]:
    """Every round folder under ``root`` (whoever wrote it, complete or not), ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_ROUND_DIR.match, os.listdir(root)) if m)


def _fingerprint_of(path: str) -> Optional[str]:
    try:
        with open(path) as fh:
            return json.load(fh).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def completed_rounds(root: str, nodes: Sequence[int], fingerprint: Optional[str] = None) -> List[int]:
    """Rounds for which every node in ``nodes`` has a complete checkpoint, ascending; with
    ``fingerprint``, only those written by that run."""
    out = []
    for k in all_rounds(root):
        paths = [os.path.join(round_dir(root, k), f"node-{n}.json") for n in nodes]
        if not all(os.path.exists(p) for p in paths):
            continue
        if fingerprint is None or all(_fingerprint_of(p) == fingerprint for p in paths):
            out.append(k)
    return out


def load_node(root: str, k: int, node: int, fingerprint: str) -> Tuple[Dict[str, torch.Tensor], Dict]:
    folder = round_dir(root, k)
    jpath = os.path.join(folder, f"node-{node}.json")
    tpath = os.path.join(folder, f"node-{node}.safetensors")
    try:
        with open(jpath) as fh:
            meta = json.load(fh)
        with open(tpath, "rb") as fh:
            tensors = st_load(fh.read())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint of node {node} at round {k} is missing in {folder}: "
                              "start without --resume or from another --out") from None
    except Exception as e:
        raise CheckpointError(f"checkpoint {folder}/node-{node} is corrupt ({type(e).__name__}): "
                              "delete that round folder to resume from the one before") from None
    if meta.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {folder} was written by another configuration (fingerprint "
            f"{meta.get('fingerprint')} != {fingerprint}): resume with the same settings, "
            "or use a new --out")
    return tensors, meta


def prune(root: str, nodes: Sequence[int], keep: int, fingerprint: str) -> None:
    """Delete this process's node files from all but the newest ``keep`` complete rounds of
    this run (``fingerprint``); other runs' files are never touched."""
    rounds = completed_rounds(root, nodes, fingerprint)
    for k in rounds[:-keep] if keep > 0 else []:
        folder = round_dir(root, k)
        for n in nodes:
            for ext in (".json", ".safetensors"):  # marker first: an unmarked round is never used
                p = os.path.join(folder, f"node-{n}{ext}")
                if os.path.exists(p):
                    os.unlink(p)
        try:
            os.rmdir(folder)  # succeeds once every node's files are gone
        except OSError:
            pass


def remove_all(root: str) -> None:
    if os.path.isdir(root):
        shutil.rmtree(root, ignore_errors=True)
