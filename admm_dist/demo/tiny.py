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
- :func:`random_qwen3` is :func:`tiny_qwen3` for any shape (``head_dim`` given, e.g. a
  Qwen3-8B-shaped model), built directly on ``device`` in ``dtype`` (on a GPU in bf16: no
  fp32 copy on the CPU); :func:`padded_char_tokenizer` is :func:`char_tokenizer` with filler
  tokens up to a model's vocabulary size, and :func:`save_random_backbone` writes the two.
  The shapes themselves are a table in :mod:`admm_dist.bench.shapes`.
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
    return _char_tokenizer(chars, None)


def padded_char_tokenizer(vocab_size: int, chars: Iterable[str] = DEFAULT_CHARS):
    """:func:`char_tokenizer` whose vocabulary is filled up to ``vocab_size`` with tokens
    ``<|x0|>``, ``<|x1|>``, ... that text never encodes to but every id decodes from (a
    random model of a real vocabulary size samples any id)."""
    return _char_tokenizer(chars, vocab_size)


def _char_tokenizer(chars: Iterable[str], pad_to: Optional[int]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in chars:
        if ch not in vocab:
            vocab[ch] = len(vocab)
    if pad_to is not None:
        if pad_to < len(vocab):
            raise ValueError(f"vocab_size {pad_to} < the {len(vocab)} tokens of the char tokenizer")
        for i in range(pad_to - len(vocab)):
            vocab[f"<|x{i}|>"] = len(vocab)
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
    return random_qwen3(vocab_size, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                        intermediate=intermediate, max_positions=max_positions, seed=seed, tie=tie)


def random_qwen3(vocab_size: int, *, hidden: int, layers: int, heads: int,
                 kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                 intermediate: Optional[int] = None, max_positions: int = 2048,
                 rope_theta: float = 10000.0, seed: int = 0, tie: bool = True,
                 device="cpu", dtype=torch.float32):
    """A randomly initialised Qwen3ForCausalLM (eval mode) of any shape, its parameters
    created on ``device`` in ``dtype`` (no detour through an fp32 copy on the CPU). With the
    defaults it is exactly :func:`tiny_qwen3`'s model (the same random draws)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        head_dim=head_dim or hidden // heads, intermediate_size=intermediate or 4 * hidden,
        max_position_embeddings=max_positions, tie_word_embeddings=tie,
        rope_theta=rope_theta, pad_token_id=0, eos_token_id=3, bos_token_id=None)
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed_all(seed)
    with torch.device(device):   # on CPU in fp32 the same draws as Qwen3ForCausalLM(cfg)
        model = Qwen3ForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval()


def save_random_backbone(folder: str, vocab_size: int, *, seed: int = 0, device="cpu",
                         dtype=torch.float32, **dims) -> str:
    """Write :func:`random_qwen3` (``dims``: its shape keywords) and a
    :func:`padded_char_tokenizer` of its vocabulary size to ``folder`` (safetensors)."""
    tok = padded_char_tokenizer(vocab_size)
    model = random_qwen3(vocab_size, seed=seed, device=device, dtype=dtype, **dims)
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def save_tiny_backbone(folder: str, *, seed: int = 0, **kw) -> str:
    """Write a tiny random Qwen3 and its char tokenizer to ``folder`` (safetensors)."""
    tok = char_tokenizer()
    model = tiny_qwen3(len(tok), seed=seed, **kw)
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder
