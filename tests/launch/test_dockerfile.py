"""The image is what the tests run: the Dockerfile passes hadolint, and the torch it installs
(launch/constraints.txt, through launch/install.sh) is the torch this suite runs on and the only
minor setup.cfg admits. (.ci/run also runs the image's install steps in a fresh venv:
launch/image_env.sh.)"""
import configparser
import shutil
import subprocess

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import REPO


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="no hadolint (bash launch/install.sh test installs it)")
def test_the_dockerfile_passes_hadolint():
    r = subprocess.run(["hadolint", "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr


def test_the_image_installs_the_torch_the_suite_runs_on_and_setup_cfg_admits_only_its_minor():
    pins = [Requirement(line) for line in (REPO / "launch" / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    torch_pin = next(r for r in pins if r.name == "torch")
    running = Version(torch.__version__.split("+")[0])
    assert running in torch_pin.specifier, (torch.__version__, str(torch_pin))
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    declared = next(Requirement(line) for line in cfg["options"]["install_requires"].splitlines()
                    if line.strip().startswith("torch"))
    assert running in declared.specifier
    below, above = Version(f"{running.major}.{running.minor - 1}.0"), Version(f"{running.major}.{running.minor + 1}.0")
    assert below not in declared.specifier and above not in declared.specifier, str(declared)
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "launch/install.sh image" in dockerfile and "pytorch/pytorch" not in dockerfile
