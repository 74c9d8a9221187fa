"""Result files written beside their final paths first, then renamed into place together.

A run's results (node files, report, ``-last``...) must appear all together or not at all: a
full disk while writing the report must not leave a new ``-last`` beside the old report.
:class:`Staged` gives, for each final path, a staged path in the same folder
(``.<name>.staged``) to write to; every problem shows while staging, before anything is
replaced; :meth:`Staged.commit` then renames them into place in the order staged (a rename in
one folder does not allocate space), and :meth:`Staged.discard` removes them.
"""
from __future__ import annotations

import errno
import os
import shutil
from typing import List, Tuple

from admm_dist.core.io import replace_dir


class Staged:
    """Staged results of one process, committed or discarded together."""

    def __init__(self) -> None:
        self.moves: List[Tuple[str, str]] = []

    def _stage(self, dst: str) -> str:
        dst = os.path.abspath(dst)
        stage = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.staged")
        remove(stage)     # a killed run's leftover
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        self.moves.append((stage, dst))
        return stage

    def file(self, dst: str) -> str:
        """Where to write the file that will become ``dst`` (refused now if a folder is there)."""
        if os.path.isdir(dst):
            raise IsADirectoryError(errno.EISDIR, "a folder is in the way of a result file", dst)
        return self._stage(dst)

    def folder(self, dst: str) -> str:
        """Where to write the folder that will become ``dst`` (refused now if a file is there)."""
        if os.path.exists(dst) and not os.path.isdir(dst):
            raise NotADirectoryError(errno.ENOTDIR, "a file is in the way of a result folder", dst)
        return self._stage(dst)

    def commit(self) -> None:
        for stage, dst in self.moves:
            if os.path.isdir(stage):
                replace_dir(stage, dst)
            else:
                os.replace(stage, dst)
        for folder in sorted({os.path.dirname(dst) for _, dst in self.moves}):
            fsync_dir(folder)
        self.moves = []

    def discard(self) -> None:
        for stage, _ in self.moves:
            remove(stage)
        self.moves = []


def remove(path: str) -> None:
    """Remove a file or a folder tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def fsync_dir(folder: str) -> None:
    """Make the renames in ``folder`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
