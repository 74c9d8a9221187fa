"""Files written atomically (a reader sees the old file or the new one, never half of one), and
JSON readers whose errors name the file and the line.

Data files are JSON/JSONL/safetensors only; nothing here unpickles.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable, List, Optional

from admm_dist.core.errors import UserError


def current_umask() -> int:
    """The process umask, read without changing it where /proc allows (thread-safe)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _naming(exc: OSError, path: str) -> OSError:
    """``exc`` as an OSError of the same errno and reason whose filename is ``path`` (the
    final file: ENOSPC from write or fsync names no file, and os.replace names the temporary)."""
    if exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), path)   # the errno's subclass


def atomic_write_bytes(path: str, data: bytes, *, before_rename: Optional[Callable[[], None]] = None) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``.

    The file gets the mode a plain ``open(path, "w")`` would give it (0666 less the umask),
    not the 0600 of the temporary file, so group members and serving accounts can read it.
    An OSError (a full disk, a folder removed under the run) names ``path``, and the
    temporary file is removed.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~current_umask())
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if before_rename is not None:   # tests only (admm_dist.testing.faults): a kill inside a write
            before_rename()
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if isinstance(exc, OSError):
            raise _naming(exc, path) from exc
        raise


def check_output_file(path: str, flag: str) -> None:
    """Refuse, before any work, an output file that could not be written at the end: ``path``
    is a folder, or its folder cannot be created (a file on the way) or written. One line
    naming ``flag``."""
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a folder: give a file path")
    here = os.path.dirname(os.path.abspath(path))    # nothing is created yet: the nearest existing folder decides
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise UserError(f"{flag} {path} cannot be written: {here} is a file; choose another {flag}")
    if not os.access(here, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path} cannot be written: {here} is read-only or not ours; choose another {flag}")


def atomic_write_json(path: str, obj: Any, *, indent: int = 2,
                      before_rename: Optional[Callable[[], None]] = None) -> None:
    text = json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=False)
    atomic_write_bytes(path, (text + "\n").encode("utf-8"), before_rename=before_rename)


def replace_dir(tmp: str, dst: str) -> None:
    """Put the finished folder ``tmp`` (a sibling of ``dst``) at ``dst``: one rename when
    ``dst`` is new; else the old folder moves aside, ``tmp`` takes its place, the old is removed."""
    import shutil

    if os.path.isdir(dst):
        old = f"{tmp}.old"
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)


def read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"{what} {path} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{what} {path} is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{what} {path} is not a JSON object")
    return obj


def read_jsonl(path: str, what: str) -> List[dict]:
    """Objects of a JSON Lines file; a bad line is a UserError naming its number."""
    if not os.path.isfile(path):
        raise UserError(f"{what} {path} does not exist")
    out = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{what} {path}: line {i} is not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise UserError(f"{what} {path}: line {i} is not a JSON object")
            out.append(obj)
    return out
