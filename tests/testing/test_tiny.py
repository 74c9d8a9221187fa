"""The offline tiny models: the character tokenizer keeps every character, newlines included."""
import os

import pytest
from transformers import AutoTokenizer

from admm_dist.testing.tiny import DEFAULT_CHARS, char_tokenizer

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
