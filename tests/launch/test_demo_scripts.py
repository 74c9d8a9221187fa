"""The demo scripts run every Python step with the interpreter ``PYTHON`` names, as
``launch/install.sh`` installs into it: no bare ``python3`` or ``torchrun`` on the PATH is
called. A stand-in interpreter records each call (the scripts' own steps are tested elsewhere:
the SmolLM2 demo end to end in tests/model/test_smollm2.py)."""
import subprocess

import pytest

from conftest import REPO

RECORDER = """#!/bin/sh
echo "$@" >> "$CALLS"
"""


@pytest.mark.parametrize("script,calls", [("cpu_demo.sh", 4), ("smollm2_demo.sh", 5)])
def test_a_demo_calls_python_only_through_PYTHON(script, calls, tmp_path):
    fake = tmp_path / "python"
    fake.write_text(RECORDER)
    fake.chmod(0o755)
    log = tmp_path / "calls"     # a bare python3 or torchrun is not recorded: one call short, or a failure
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "CALLS": str(log), "HOME": str(tmp_path),
           "MODEL": str(tmp_path / "model"), "OUT": str(tmp_path / "run"), "RES": str(tmp_path / "res")}
    r = subprocess.run(["bash", str(REPO / "launch" / script)], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    lines = log.read_text().splitlines()
    assert len(lines) == calls, lines
    assert any(line.startswith("-m torch.distributed.run ") and " -m admm_dist.train " in line for line in lines)
