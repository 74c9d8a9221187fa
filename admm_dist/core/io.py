"""Files written atomically (a reader sees the old file or the new one, never half of one),
JSON readers whose errors name the file and the line, and a model folder's entries checked to be
files or folders before anything in it is opened.

Data files are JSON/JSONL/safetensors only; nothing here unpickles.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from typing import Any, List

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


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write to a new temporary file in the same folder, fsync, then rename over ``path``.

    Nothing follows a link: the folder is opened once and every step is taken through that
    descriptor (a folder swapped for a link meanwhile is not written into); the temporary is
    created with ``O_EXCL | O_NOFOLLOW`` (a planted name is never opened), and the rename
    replaces whatever is at ``path`` (a link there is replaced, its target untouched).
    The file gets the mode a plain ``open(path, "w")`` would give it (0666 less the umask),
    so group members and serving accounts can read it. An OSError (a full disk, a folder
    removed under the run) names ``path``, and the temporary file is removed.
    """
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = None
    dfd = None
    try:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        for _ in range(100):
            candidate = f".{name}.{secrets.token_hex(4)}.tmp"
            try:
                fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600, dir_fd=dfd)
            except FileExistsError:
                continue
            tmp = candidate
            break
        else:
            raise FileExistsError(errno.EEXIST, "no free temporary name", path)
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~current_umask())
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        tmp = None
    except BaseException as exc:
        if tmp is not None and dfd is not None:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
        if isinstance(exc, OSError):
            raise _naming(exc, path) from exc
        raise
    finally:
        if dfd is not None:
            os.close(dfd)


def own_folder(path: str, what: str) -> str:
    """Create the folder ``path`` that the trainer keeps its own files in (checkpoint rounds, a
    run's folder), refusing in one line a link, or anything not a folder, at that name: what the
    trainer writes there must not land where a link points. Returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UserError(f"{what} {path} is a symbolic link, where the trainer keeps its own folder: "
                        "remove the link (nothing was written through it), or choose another out=")
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} {path} exists and is not a folder: move it away, or choose another out=")
    return path


def check_output_file(path: str, flag: str) -> None:
    """Refuse, before any work, an output file that could not be written at the end: ``path``
    is a folder, or its folder cannot be created (a file on the way) or written. One line
    naming ``flag``."""
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a folder: give a file path")
    # nothing is created yet: the nearest existing folder decides
    here = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise UserError(f"{flag} {path} cannot be written: {here} is a file; choose another {flag}")
    if not os.access(here, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path} cannot be written: {here} is read-only or not ours; "
                        f"choose another {flag}")


def atomic_write_json(path: str, obj: Any, *, indent: int = 2) -> None:
    text = json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=False)
    atomic_write_bytes(path, (text + "\n").encode("utf-8"))


def replace_dir(tmp: str, dst: str) -> None:
    """Put the finished folder ``tmp`` (a sibling of ``dst``) at ``dst``: one rename when
    ``dst`` is new; else the old folder moves aside, ``tmp`` takes its place, the old is removed."""
    import shutil

    if os.path.islink(dst):    # a link is replaced, never followed
        os.unlink(dst)
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


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device",
          stat.S_IFBLK: "a device"}


def check_model_files(folder: str, what: str) -> None:
    """Refuse, in one line starting with ``what``, an entry of the model folder ``folder`` that
    is neither a regular file nor a folder, once its links are followed (a hub snapshot's files
    are links to its blobs): opening a FIFO blocks until someone writes to it, and a device such
    as /dev/zero can be read forever. Nothing in the folder is opened before this check, by either loader."""
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            path = os.path.join(folder, entry.name)
            path = path if path.isprintable() else ascii(path)    # one line, whatever the name
            try:
                mode = os.stat(entry.path).st_mode
            except OSError as exc:     # a link to nothing, or a loop of links
                raise UserError(f"{what} {path} cannot be read ({exc.strerror}): remove it or put "
                                f"the model's own file there") from None
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                link = " (through a symbolic link)" if entry.is_symlink() else ""
                raise UserError(f"{what} {path} is {_KINDS.get(stat.S_IFMT(mode), 'not a file')}{link}, "
                                f"not a regular file: put the model's own file there (nothing was read "
                                f"from it)")
