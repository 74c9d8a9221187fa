"""The trainer plans before it loads (admm_dist/training/memory_plan.py): a job that will not fit
its device is refused by ``admm_dist.train`` itself, before any weights are read, in one line that
names a change that fits, rehearsed; ``plan_memory=false`` turns the check off."""
import re
import shutil

import pytest

from admm_dist.cli import train
from admm_dist.core.text import parse_size, size_text, size_unit

from conftest import REPO

# the tiny backbone's CPU run at one rank (float32), its examples cut short: its peak is about
# 13 MiB, most of it activations; about 7.5 MiB at micro_batches=2
TINY = ["--config", str(REPO / "configs" / "cpu" / "admm_ring.yaml"), "max_prompt_tokens=48",
        "max_target_tokens=64"]


@pytest.fixture
def shapes_only(tmp_path):
    """A backbone folder holding its config.json and nothing else: no weights to read."""
    folder = tmp_path / "shapes"
    folder.mkdir()
    shutil.copy(REPO / "assets" / "tiny" / "backbone" / "config.json", folder / "config.json")
    return folder


def _train(capsys, tmp_path, *args):
    """``python -m admm_dist.train`` in this process: (exit code, stderr)."""
    code = train.main([*TINY, f"out={tmp_path / 'run'}", f"report_dir={tmp_path}", *args])
    return code, capsys.readouterr().err


def test_a_job_that_will_not_fit_is_refused_before_its_weights_are_read_naming_a_change_that_fits(
        capsys, tmp_path, shapes_only):
    code, err = _train(capsys, tmp_path, f"model_name={shapes_only}", "device_memory=9MiB")
    line = err.strip()
    assert code == 2, err
    assert len(line.splitlines()) == 1, line
    m = re.match(r"admm_dist\.train: error on rank 0: this job will not fit its devices: its seat ranks need "
                 r"([0-9.]+) MiB of 9\.00 MiB x 90%; micro_batches=2 fits \(([0-9.]+) MiB, rehearsed\): "
                 r"torchrun --nnodes 1 --nproc_per_node 1 -m admm_dist\.train .* micro_batches=2; "
                 r"python -m admm_dist\.plan shows the plan, plan_memory=false skips this check$", line)
    assert m and float(m.group(2)) <= 0.9 * 9 < float(m.group(1)), line
    assert not (tmp_path / "run").exists()
    # Off: the same job goes on to read its weights, and the loader says there are none.
    code, err = _train(capsys, tmp_path, f"model_name={shapes_only}", "device_memory=9MiB", "plan_memory=false")
    assert code == 2 and "will not fit" not in err and "no file named model.safetensors" in err, err


def test_a_bad_device_memory_is_one_line(capsys, tmp_path):
    with pytest.raises(ValueError, match="give a size such as 80GiB"):
        parse_size("lots")
    assert parse_size("80GiB") == 80 << 30 and parse_size("40GB") == 40 * 10 ** 9 and parse_size("512M") == 512 << 20
    # and shown back in one rule: GiB, or MiB below 1 GiB (the plan's lines and table)
    assert size_text(80 << 30) == "80.00 GiB" and size_text(3 << 19) == "1.50 MiB" and size_text(1000) == "0.00 MiB"
    assert size_unit(1023 << 20, smallest="MiB") == ("MiB", 1 << 20) and size_unit(2048) == ("KiB", 1024)
    code, err = _train(capsys, tmp_path, "device_memory=-3G")
    assert code == 2 and err.strip() == ("admm_dist.train: error: device_memory='-3G': give a size such as 80GiB, "
                                         "40GB or 24G"), err


def test_a_backbone_the_rehearsal_cannot_build_is_said_in_one_line_and_the_job_goes_on(capsys, tmp_path):
    """The check is advice: a backbone it cannot rehearse (here a T5, which is no causal LM) is
    one line on rank 0, and the run goes on to its own checks (the loader refuses this one)."""
    folder = tmp_path / "t5"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "t5"}')
    code = train.main([*TINY, f"model_name={folder}", "device_memory=9MiB", f"out={tmp_path / 'run'}",
                       f"report_dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert "memory plan: could not rehearse this job (ValueError: " in out, out
    assert "going on without it (plan_memory=false skips the attempt)" in out
    assert code == 2 and err.startswith("admm_dist.train: error on rank 0: ") and "will not fit" not in err, err
