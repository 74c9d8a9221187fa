"""Tiny offline models for tests, benchmarks and the CPU default: nothing is downloaded.

- :func:`char_tokenizer` builds a character-level tokenizer with ``tokenizers``
  (WordLevel over single characters, a Split pre-tokenizer and a Fuse decoder),
  wrapped in ``PreTrainedTokenizerFast`` with a Qwen3-style chat template, so
  prompts go through ``apply_chat_template`` exactly as for a real model. It
  saves and reloads with ``AutoTokenizer.from_pretrained(folder)``.
- :func:`tiny_qwen3` builds a randomly initialised ``Qwen3ForCausalLM`` from a
  config (the real model class, so every code path is the real one).
- :func:`save_tiny_backbone` writes both to a folder that
  ``AutoModelForCausalLM.from_pretrained`` loads with no network.
"""
from __future__ import annotations

import string
from typing import Iterable, Optional

import torch

SPECIALS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
DEFAULT_CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer(chars: Iterable[str] = DEFAULT_CHARS):
    """A character-level fast tokenizer with special tokens and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in chars:
        if ch not in vocab:
            vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # "." skips newlines
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
        bos_token=None, unk_token="<|endoftext|>", padding_side="left",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_qwen3(vocab_size: int, *, hidden: int = 64, layers: int = 2, heads: int = 4,
               kv_heads: Optional[int] = None, intermediate: Optional[int] = None,
               max_positions: int = 2048, seed: int = 0, tie: bool = True):
    """A randomly initialised Qwen3ForCausalLM (fp32, eval mode)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        head_dim=hidden // heads, intermediate_size=intermediate or 4 * hidden,
        max_position_embeddings=max_positions, tie_word_embeddings=tie,
        rope_theta=10000.0, pad_token_id=0, eos_token_id=3, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    return model.eval()


def save_tiny_backbone(folder: str, *, seed: int = 0, **kw) -> str:
    """Write a tiny random Qwen3 and its char tokenizer to ``folder`` (safetensors)."""
    tok = char_tokenizer()
    model = tiny_qwen3(len(tok), seed=seed, **kw)
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder
