"""The stand-in backbone: training data follow the chain's own prompts, training is
deterministic, the shipped folder loads offline and is competent in part."""
import json
import os
import random
import subprocess
import sys

import pytest

from admm_dist.cli import standin as standin_cli
from admm_dist.tasks.chain_arith import load_chain_arith
from admm_dist.tasks.scoring import extract_number
from admm_dist.demo import standin

SHIPPED = str(standin.DEFAULT_DIR)


def test_training_chain_follows_each_seats_input_even_a_wrong_one():
    item = load_chain_arith("train", n=1, seed=0)[0]
    rng = random.Random(0)
    for _ in range(50):
        chain, bad = standin.training_chain(item, 4, rng, corrupt_p=1.0)
        assert 0 <= bad < 3
        for seat, hist, target in chain:
            assert len(hist) == seat
            src = item["start"] if seat == 0 else int(extract_number(hist[-1]))
            want = src if seat == 3 else standin.apply_op(src, item["ops"][seat][0], int(item["ops"][seat][1:]))
            assert int(extract_number(target)) == want   # correct given what it read
        # exactly one upstream message was corrupted: the final answer is wrong
        assert extract_number(chain[-1][2]) != item["gold"]


def test_wrong_message_moves_the_last_number_only():
    rng = random.Random(1)
    for text, keep in [("12+5=17", "12+5="), ("Answer: -4", "Answer: "), ("3*2=6", "3*2=")]:
        w = standin.wrong_message(text, rng)
        assert w.startswith(keep) and extract_number(w) != extract_number(text)


def test_regeneration_is_deterministic(tmp_path):
    """A shortened recipe, twice with the same seed and thread count: the same bytes."""
    kw = dict(steps=3, batch=8, hidden=32, intermediate=64, warmup=2, threads=1, log_every=0)
    a = standin.train(str(tmp_path / "a"), seed=5, **kw)
    b = standin.train(str(tmp_path / "b"), seed=5, **kw)
    c = standin.train(str(tmp_path / "c"), seed=6, **kw)
    da, db, dc = (standin.folder_digest(str(tmp_path / x)) for x in "abc")
    assert da == db and a["final_loss"] == b["final_loss"]
    assert da["model.safetensors"] != dc["model.safetensors"] and c["final_loss"] is not None
    assert {"model.safetensors", "config.json", "tokenizer.json", "standin.json"} <= set(da)


def test_the_shipped_folder_loads_offline_through_the_auto_classes():
    code = (
        "import torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"tok = AutoTokenizer.from_pretrained({SHIPPED!r})\n"
        f"model = AutoModelForCausalLM.from_pretrained({SHIPPED!r})\n"
        "msgs = [{'role': 'user', 'content': 'Start 3: +4 *2 -1'}]\n"
        "text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)\n"
        "assert text.endswith('<|im_start|>assistant\\n'), text\n"
        "print(type(model).__name__, sum(p.numel() for p in model.parameters()))\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME="/nonexistent")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("Qwen3ForCausalLM")
    size = sum(os.path.getsize(os.path.join(SHIPPED, f)) for f in os.listdir(SHIPPED))
    assert size <= 5 * 2 ** 20, f"the shipped stand-in is {size} bytes: over 5 MB"


def test_shipped_standin_is_partly_competent_and_reads_its_inputs(tmp_path):
    """A small version of `standin check` (the full one is in docs/standin.md)."""
    path = tmp_path / "check.json"
    assert standin_cli.main(["check", "--n", "40", "--samples", "4", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert set(res) >= {"sampled_acc", "mixed_share", "greedy_acc", "seat_influence"}
    assert 0.1 <= res["sampled_acc"] <= 0.9 and res["mixed_share"] >= 0.3
    assert len(res["seat_influence"]) == 4 and min(res["seat_influence"]) >= 0.3


def test_check_names_a_missing_model(tmp_path, capsys):
    assert standin_cli.main(["check", "--model", str(tmp_path)]) == 2
    assert "config.json missing" in capsys.readouterr().err


def test_unknown_recipe_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown recipe keys"):
        standin.train(str(tmp_path / "x"), hiden=3)
