"""The atomic writer on real failures: an OSError from write (a file-size limit, as a full disk
would give) or from the rename names the final path, never the temporary, and leaves no
temporary behind; the file already at the path is untouched."""
import errno
import json
import os
import subprocess
import sys

import pytest

from admm_dist.core.io import atomic_write_bytes

from conftest import REPO

# A child process whose files may not grow past 4 KiB: write() then fails with EFBIG (SIGXFSZ
# ignored), a real OSError from the kernel that, like ENOSPC, carries no filename.
LIMITED_WRITE = r"""
import json, os, resource, signal, sys
from admm_dist.core.io import atomic_write_bytes
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    atomic_write_bytes(sys.argv[1], b"x" * 65536)
except OSError as e:
    print(json.dumps({"type": type(e).__name__, "errno": e.errno, "filename": e.filename, "text": str(e)}))
    sys.exit(3)
"""


def test_a_failed_write_names_the_final_path_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "report.json"
    path.write_bytes(b"the previous report\n")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", LIMITED_WRITE, str(path)], capture_output=True, text=True,
                          env=env, cwd=str(tmp_path), timeout=60)
    assert proc.returncode == 3, proc.stderr
    err = json.loads(proc.stdout)
    assert err["errno"] == errno.EFBIG and err["filename"] == str(path), err
    assert err["text"] == f"[Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)}: '{path}'"
    assert sorted(os.listdir(tmp_path)) == ["report.json"]      # the temporary is gone
    assert path.read_bytes() == b"the previous report\n"


def test_a_failed_rename_names_the_final_path_not_the_temporary(tmp_path):
    path = tmp_path / "out-last.safetensors"
    path.mkdir()
    (path / "keep").write_text("x")          # a non-empty folder where the file goes
    with pytest.raises(OSError) as info:
        atomic_write_bytes(str(path), b"data")
    assert info.value.filename == str(path) and info.value.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)
    assert isinstance(info.value, IsADirectoryError) or info.value.errno != errno.EISDIR   # the errno's subclass
    assert sorted(os.listdir(tmp_path)) == ["out-last.safetensors"]


def test_a_write_gets_the_mode_of_a_plain_open(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write_bytes(str(tmp_path / "f"), b"data")
    finally:
        os.umask(old)
    assert (tmp_path / "f").read_bytes() == b"data"
    assert os.stat(tmp_path / "f").st_mode & 0o777 == 0o640


def test_a_write_replaces_a_link_at_its_path_and_never_writes_its_target(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("precious\n")
    link = tmp_path / "report.json"
    os.symlink(target, link)
    atomic_write_bytes(str(link), b"the report\n")
    assert not os.path.islink(link) and link.read_bytes() == b"the report\n"
    assert target.read_text() == "precious\n"
    assert sorted(os.listdir(tmp_path)) == ["precious.txt", "report.json"]     # no temporary left


def test_a_folder_the_trainer_owns_is_never_a_link(tmp_path):
    from admm_dist.core.errors import UserError
    from admm_dist.core.io import own_folder

    assert own_folder(str(tmp_path / "a" / "b"), "the checkpoint folder") == str(tmp_path / "a" / "b")
    os.symlink(tmp_path / "a", tmp_path / "link")
    with pytest.raises(UserError, match="is a symbolic link, where the trainer keeps its own folder"):
        own_folder(str(tmp_path / "link"), "the checkpoint folder")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="exists and is not a folder"):
        own_folder(str(tmp_path / "file"), "the checkpoint folder")
