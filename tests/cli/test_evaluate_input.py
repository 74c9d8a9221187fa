"""``python -m admm_dist.evaluate`` refuses in one line (issue 21): an ``--offset`` past the task's
rows (was a ZeroDivisionError), an adapter trained on another backbone of the same shape (was
silently accepted), a ``--train_report`` of another task (was silently accepted), and a device
outside auto, cpu, cuda, cuda:N. Real backbones, real files, the real command."""
import json
import os
import shutil

import pytest
import torch

from admm_dist.cli.evaluate import main
from admm_dist.core.errors import UserError

from conftest import REPO

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
STANDIN = os.path.join(str(REPO), "assets", "standin")
TINY = os.path.join(str(REPO), "assets", "tiny", "backbone")
ADAPTER = dict(lora_rank=4, lora_alpha=8.0, lora_layers_last=2, lora_basis_seed=42)
BASE = ["--task", "chain_arith", "--max_new_tokens", "4", "--device", "cpu"]


def evaluate(capsys, *argv):
    rc = main(BASE + list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------ 7. --offset past the rows
@pytest.mark.parametrize("offset", ["100000", "2000"])
def test_an_offset_past_the_rows_without_n_is_one_line(capsys, offset):
    rc, out, err = evaluate(capsys, "--model_name", STANDIN, "--offset", offset)
    assert rc == 2 and out == ""
    assert one_line(err) == (f"admm-dist-evaluate: error: --offset {offset}: task chain_arith has 2000 rows "
                             "in split eval: pass an --offset below 2000")


# ------------------------------------------------------------------ 8a. an adapter of another backbone
@pytest.fixture(scope="module")
def other_backbone(tmp_path_factory):
    """assets/tiny/backbone with every weight moved a little: the same shape, another backbone."""
    from transformers import AutoModelForCausalLM
    folder = str(tmp_path_factory.mktemp("other") / "backbone")
    model = AutoModelForCausalLM.from_pretrained(TINY, local_files_only=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    model.save_pretrained(folder)
    for name in os.listdir(TINY):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(TINY, name), folder)
    return folder


@pytest.fixture(scope="module")
def other_vector(other_backbone, tmp_path_factory):
    """A B vector trained (here: drawn) on ``other_backbone``, saved as the trainer saves it."""
    from transformers import AutoModelForCausalLM

    from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
    from admm_dist.model.vectors import save_vector
    adapter = BOnlyLoRA(AutoModelForCausalLM.from_pretrained(other_backbone, local_files_only=True),
                        AdapterConfig(**ADAPTER))
    vec = torch.randn(adapter.numel, generator=torch.Generator().manual_seed(0))
    path = str(tmp_path_factory.mktemp("vec") / "run-last.safetensors")
    save_vector(path, vec, {}, adapter=adapter)
    return path


def test_an_adapter_of_another_backbone_of_the_same_shape_is_refused_naming_both(capsys, other_backbone,
                                                                                  other_vector):
    from safetensors import safe_open
    with safe_open(other_vector, "pt") as fh:
        weights = json.loads(fh.metadata()["meta"])["adapter"].get("backbone", {}).get("weights", "")[:12]
    rc, out, err = evaluate(capsys, "--model_name", TINY, "--adapter", other_vector, "--n", "1")
    assert rc == 2 and out == ""
    line = one_line(err)
    assert line.startswith(f"admm-dist-evaluate: error: {other_vector} was trained on backbone {other_backbone} "
                           f"(weights {weights}) but the loaded backbone is {TINY} (weights ")
    assert line.endswith(f"): load it on the backbone it was trained on (--model_name {other_backbone})")
    # on the backbone it was trained on it runs
    rc, out, err = evaluate(capsys, "--model_name", other_backbone, "--adapter", other_vector, "--n", "1")
    assert rc == 0 and out.startswith("accuracy "), err


# ------------------------------------------------------------------ 8b. a training report of another task
def test_a_train_report_of_another_task_is_refused_naming_both(capsys, tmp_path):
    report = tmp_path / "gsm-train.json"
    report.write_text(json.dumps({"config": {"task": "gsm8k"}, "anchor_keys": ["k"]}))
    rc, out, err = evaluate(capsys, "--model_name", STANDIN, "--train_report", str(report), "--n", "1")
    assert rc == 2 and out == ""
    assert one_line(err) == (f"admm-dist-evaluate: error: --train_report {report} is the report of a run on "
                             "task gsm8k, but this evaluates task chain_arith: pass the report of the "
                             "chain_arith run (or --task gsm8k)")


@pytest.mark.parametrize("report, task", [
    ({"config": {"task": "chain_arith"}}, "chain_arith"),
    # a run on a pre-built fit set: `task` is a label; the fit set's task counts when it is a task
    ({"config": {"task": "fitset"}, "fitset_settings": {"task": "gsm8k"}}, "gsm8k"),
    ({"config": {"task": "fitset"}, "fitset_settings": {"task": "fitset"}}, None),
    ({"config": {"task": "fitset"}, "fitset_settings": {"task": "synthetic"}}, None),
    ({"anchor_keys": []}, None),
])
def test_the_task_a_report_trained_on(tmp_path, report, task):
    from admm_dist.mas.evaluation import check_report_task, report_task
    assert report_task(report) == task
    path = tmp_path / "r-train.json"
    path.write_text(json.dumps(report))
    if task in (None, "chain_arith"):      # unknown, or the same: kept (its anchor keys still guard)
        check_report_task(str(path), "chain_arith")
    else:
        with pytest.raises(UserError, match=f"run on task {task}, but this evaluates task chain_arith"):
            check_report_task(str(path), "chain_arith")


# ------------------------------------------------------------------ 5. the device
def test_an_unknown_device_is_one_line_and_cuda_n_is_a_valid_form(capsys):
    rc, out, err = evaluate(capsys, "--model_name", STANDIN, "--device", "tpu", "--n", "1")
    assert rc == 2 and one_line(err) == ("admm-dist-evaluate: error: device='tpu' is not supported: use auto, "
                                         "cpu, cuda or cuda:N (e.g. device=cuda:0)")
    assert main(["--help"]) == 0
    assert "--device DEVICE" in capsys.readouterr().out
