"""Progress bars: drawn on a terminal (a real pseudo-terminal here), absent from a redirected
log, absent under ``quiet``; the training command shows its rounds, reference log-probs and
collection on a terminal and writes plain lines to a file."""
import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from conftest import REPO, tiny_args, train_cmd

N = 2


def on_terminal(cmd, timeout=240, env=None):
    """Run ``cmd`` with stdout and stderr on a new pseudo-terminal (120 columns); its output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=REPO,
                            env=env, close_fds=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:          # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        else:
            pytest.fail(f"{cmd} did not finish on the terminal within {timeout}s")
        assert proc.wait(timeout=30) == 0, out.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        os.close(master)
    return out.decode(errors="replace")


BAR = "import sys; from admm_dist.core import progress\n" \
      "for _ in progress.bar(range(5), desc='work', show='quiet' not in sys.argv): pass\n" \
      "progress.say('line after')\n"


def test_a_bar_is_drawn_on_a_terminal():
    out = on_terminal([sys.executable, "-c", BAR])
    assert "work: 100%" in out and "5/5" in out and "\r" in out
    assert "line after" in out


def test_no_bar_in_a_redirected_log_or_when_quiet(tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "wb") as f:
        subprocess.run([sys.executable, "-c", BAR], stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                       check=True, timeout=60)
    assert log.read_text() == "line after\n"
    out = on_terminal([sys.executable, "-c", BAR, "quiet"])
    assert "work" not in out and "line after" in out


def _train_cmd(assets, tmp_path, *extra):
    return train_cmd([*tiny_args(assets, k_outer=3, out=tmp_path / "run", report_dir=tmp_path / "reports"), *extra])


def test_training_shows_its_rounds_on_a_terminal_and_plain_lines_in_a_log(tiny_assets, tmp_path, capfd):
    from admm_dist.cli import train

    assets = tiny_assets(N)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = on_terminal(_train_cmd(assets, tmp_path / "tty"), env=env)
    assert "rounds: 100%" in out and "3/3" in out
    assert "reference log-probs" in out
    assert "round   3/3" in out       # the log lines still come, above the bar

    # into a log: the command's own main in this process, its stdout and stderr captured into
    # files (not a terminal), as a redirected run's are
    capfd.readouterr()
    assert train.main(_train_cmd(assets, tmp_path / "file")[3:]) == 0
    text = "".join(capfd.readouterr())
    assert "round   3/3" in text
    assert "\r" not in text and "%|" not in text and "rounds:" not in text


def test_quiet_training_shows_neither_bars_nor_round_lines(tiny_assets, tmp_path, capfd):
    """The command's own main, in this process (a terminal or not, quiet says nothing per round)."""
    from admm_dist.cli import train
    argv = _train_cmd(tiny_assets(N), tmp_path / "quiet", "quiet=true")[3:]
    assert train.main(argv) == 0
    out, err = capfd.readouterr()
    assert "rounds:" not in out + err and "round   1/3" not in out + err
    assert (tmp_path / "quiet" / "run-last.safetensors").exists()
