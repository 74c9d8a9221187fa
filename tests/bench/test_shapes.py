"""The shape table holds the real models' shapes, and a saved backbone of a shape loads offline."""
import json

import pytest
import torch

from admm_dist.bench import shapes
from admm_dist.demo.tiny import random_qwen3


def test_the_table_has_qwen3_shapes():
    def row(s):
        return (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab, s.tie)
    assert row(shapes.get("qwen3-0.6b")) == (1024, 28, 16, 8, 128, 3072, 151936, True)
    assert row(shapes.get("qwen3-8b")) == (4096, 36, 32, 8, 128, 12288, 151936, False)
    assert row(shapes.get("tiny")) == (256, 4, 4, 4, 64, 1024, 4096, True)
    with pytest.raises(ValueError, match=r"^unknown shape 'qwen3-9b': choose one of micro, tiny, qwen3-0.6b, qwen3-8b$"):
        shapes.get("qwen3-9b")


@pytest.mark.parametrize("name", list(shapes.SHAPES))
def test_parameter_count_is_the_built_models(name):
    s = shapes.get(name)
    model = random_qwen3(s.vocab, device="meta", **s.dims())     # shapes only, no memory
    assert sum(p.numel() for p in model.parameters()) == s.n_params()
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.tie_word_embeddings) == (
        s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.tie)
    assert round(s.n_params() / 1e6, 1) == {"micro": 0.2, "tiny": 5.2, "qwen3-0.6b": 596.0, "qwen3-8b": 8190.7}[name]


def test_devices():
    assert shapes.resolve_device("cpu") == torch.device("cpu")
    assert shapes.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        shapes.resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            shapes.resolve_device("cuda")


def test_save_a_backbone_that_loads_offline(tmp_path, capsys):
    from admm_dist.model.loading import load_model

    assert shapes.main(["--save", str(tmp_path / "bb"), "--shape", "tiny"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["shape"] == "tiny" and info["dtype"] == "float32" and info["params"] == shapes.get("tiny").n_params()
    model, tok = load_model(str(tmp_path / "bb"), torch.device("cpu"))
    assert len(tok) == model.config.vocab_size == 4096
    assert tok.decode(tok("Start 3: +4")["input_ids"]) == "Start 3: +4"
    assert shapes.main([]) == 0
    assert "qwen3-8b" in capsys.readouterr().out
