"""The output lock (admm_dist/core/lock.py) against hostile and careless lock files: a link, a
FIFO or a folder at the lock's name, crafted fields, and two names of one folder (issue 40)."""
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from admm_dist.core.lock import LockedError, OutputLock


def _lock(path):
    return OutputLock([(str(path), f"out={path}", "another out=")])


def test_a_lock_that_is_a_link_is_refused_and_its_target_never_written(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("precious\n")
    os.symlink(precious, tmp_path / "run.lock")
    with pytest.raises(LockedError) as e:
        _lock(tmp_path / "run").acquire()
    msg = str(e.value)
    assert "\n" not in msg and f"{tmp_path / 'run.lock'} is a symbolic link, not a lock file" in msg
    assert "remove it" in msg and "another out=" in msg
    assert precious.read_text() == "precious\n"
    assert os.path.islink(tmp_path / "run.lock")            # left as it was


def test_a_dangling_link_is_not_followed_to_create_its_target(tmp_path):
    os.symlink(tmp_path / "made_by_the_link", tmp_path / "run.lock")
    with pytest.raises(LockedError, match="is a symbolic link"):
        _lock(tmp_path / "run").acquire()
    assert not os.path.lexists(tmp_path / "made_by_the_link")


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_lock_that_is_a_fifo_or_a_folder_is_refused_naming_it(tmp_path, kind):
    path = tmp_path / "run.lock"
    os.mkfifo(path) if kind == "fifo" else os.mkdir(path)
    with pytest.raises(LockedError) as e:
        _lock(tmp_path / "run").acquire()
    word = "a FIFO" if kind == "fifo" else "a folder"
    assert f"{path} is {word}, not a lock file" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("fields, why", [
    ({"since": 1e400}, "'since'"),                              # json.dumps writes Infinity
    ({"since": float("nan")}, "'since'"),
    ({"pid": 1180591620717411303424}, "pid"),
    ({"pid": 0}, "pid 0 is not a process id"),
    ({"pid": -5}, "pid"),
    ({"pid": "12"}, "pid"),
    ({"host": "x" * 1000}, "'host'"),
    ({"host": "a\nb"}, "'host'"),
    ({"start": "not digits"}, "'start'"),
])
def test_every_lock_field_is_validated(fields, why):
    from admm_dist.core.lock import MalformedLock, parse_holder

    d = dict({"pid": 123, "host": "h", "start": "1", "job": None, "since": 1.0}, **fields)
    with pytest.raises(MalformedLock, match=why):
        parse_holder(json.dumps(d).encode())


def test_a_crafted_lock_of_this_host_is_taken_over_with_a_note_not_a_traceback(tmp_path):
    for fields in ({"since": 1e400}, {"pid": 1180591620717411303424}, {"pid": 0}):
        path = tmp_path / "run.lock"
        path.write_text(json.dumps(dict({"pid": 1, "host": socket.gethostname(), "since": 0}, **fields)))
        lock = _lock(tmp_path / "run").acquire()
        try:
            assert len(lock.notes) == 1 and "took over a malformed lock file" in lock.notes[0], lock.notes
            assert json.loads(path.read_text())["pid"] == os.getpid()
        finally:
            lock.release()
        assert not path.exists()


def test_a_malformed_lock_naming_no_host_of_ours_is_refused_in_one_line(tmp_path):
    path = tmp_path / "run.lock"
    for text in (json.dumps({"pid": 0, "host": "elsewhere", "since": 0}), "{not json", "x" * 10000):
        path.write_text(text)
        with pytest.raises(LockedError) as e:
            _lock(tmp_path / "run").acquire()
        msg = str(e.value)
        assert "\n" not in msg and f"its lock file {path} is malformed" in msg and "remove it" in msg
        assert path.read_text() == text                      # not written


def test_an_empty_lock_file_is_taken(tmp_path):
    (tmp_path / "run.lock").write_text("")
    lock = _lock(tmp_path / "run").acquire()
    lock.release()
    assert lock.notes == []


def test_two_names_of_one_folder_take_one_lock(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from admm_dist.core.lock import OutputLock
        OutputLock([({str(real)!r}, "out=real", "another out=")]).acquire()
        print("locked", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockedError, match=f"is in use by a running job \\(pid {holder.pid} "):
            _lock(tmp_path / "link").acquire()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
