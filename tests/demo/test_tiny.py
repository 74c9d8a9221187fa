"""The offline tiny models: the character tokenizer keeps every character, newlines included."""
import os

import pytest
from transformers import AutoTokenizer

from admm_dist.demo.tiny import DEFAULT_CHARS, char_tokenizer

from conftest import REPO

ROOT = str(REPO)


@pytest.mark.parametrize("where", ["built", "assets/standin", "assets/tiny/backbone"])
def test_blank_lines_and_every_character_round_trip_without_the_unknown_token(where):
    tok = char_tokenizer() if where == "built" else AutoTokenizer.from_pretrained(os.path.join(ROOT, where))
    unk = tok.convert_tokens_to_ids("<|endoftext|>")
    nl = tok.convert_tokens_to_ids("\n")
    assert tok("a\n\nb", add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids("a"), nl, nl,
                                                                    tok.convert_tokens_to_ids("b")]
    text = DEFAULT_CHARS + "\n\n\n" + DEFAULT_CHARS[::-1]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert unk not in ids and len(ids) == len(text)
    assert tok.decode(ids) == text
    # the default wording's blank line after the question reaches the model as two newlines
    chat = tok.apply_chat_template([{"role": "user", "content": "Question:\nq\n\nAgents so far:"}],
                                   tokenize=False, add_generation_prompt=True)
    assert unk not in tok(chat, add_special_tokens=False)["input_ids"]


def test_shipped_tokenizers_are_the_built_one():
    built = char_tokenizer()
    for where in ("assets/standin", "assets/tiny/backbone"):
        shipped = AutoTokenizer.from_pretrained(os.path.join(ROOT, where))
        assert shipped.get_vocab() == built.get_vocab()
        sample = "Start 20: +6 *2 +8\n\n20+6=26\nAnswer: 60 <think>x</think>\t~"
        assert shipped(sample)["input_ids"] == built(sample)["input_ids"]


def test_random_qwen3_defaults_are_tiny_qwen3s_draws():
    """tiny_qwen3 is random_qwen3 with its defaults: the same weights as Qwen3ForCausalLM(config)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from admm_dist.demo.tiny import random_qwen3, tiny_qwen3

    cfg = Qwen3Config(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=16, intermediate_size=256, max_position_embeddings=2048,
                      tie_word_embeddings=True, rope_theta=10000.0, pad_token_id=0, eos_token_id=3,
                      bos_token_id=None)
    torch.manual_seed(3)
    ref = Qwen3ForCausalLM(cfg).state_dict()
    for model in (tiny_qwen3(120, seed=3), random_qwen3(120, hidden=64, layers=2, heads=4, seed=3)):
        got = model.state_dict()
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
        assert not model.training and next(model.parameters()).dtype == torch.float32
    wide = random_qwen3(120, hidden=64, layers=1, heads=2, kv_heads=1, head_dim=48, intermediate=96,
                        tie=False, dtype=torch.bfloat16)
    attn = wide.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (96, 64) and attn.k_proj.weight.shape == (48, 64)
    assert wide.lm_head.weight.dtype == torch.bfloat16
    assert wide.lm_head.weight.data_ptr() != wide.model.embed_tokens.weight.data_ptr()


def test_padded_char_tokenizer_fills_the_vocabulary(tmp_path):
    from transformers import AutoModelForCausalLM

    from admm_dist.demo.tiny import padded_char_tokenizer, save_random_backbone

    tok = padded_char_tokenizer(300)
    assert len(tok) == 300 and tok.get_vocab() | char_tokenizer().get_vocab() == tok.get_vocab()
    text = "Question:\nq\n\n" + DEFAULT_CHARS
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.decode([299]) == f"<|x{299 - len(char_tokenizer())}|>"    # every id decodes
    with pytest.raises(ValueError, match="vocab_size 50 < the 102 tokens"):
        padded_char_tokenizer(50)
    folder = save_random_backbone(str(tmp_path / "bb"), 300, hidden=32, layers=1, heads=2)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert model.config.vocab_size == len(loaded) == 300
    assert model.config.pad_token_id == loaded.pad_token_id and model.config.eos_token_id == loaded.eos_token_id
