"""Command-line tools around evaluation: ``build_fitset`` (trajectories -> fit set) and
``judge_fitset`` (label a fit set with a judge model), plus the plumbing they share with
:mod:`admm_dist.evaluate`: a parser whose errors are one line, a ``main`` wrapper that
turns bad input into a one-line message and exit code 2, and backbone loading.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, List, Optional, Sequence

from ..mas.vllm_backend import VLLMBackendError   # imports no vLLM; raised when it cannot run

EXIT_BAD_INPUT = 2
# What bad input raises: ValueError covers AdapterError, FitSetError, DistConfigError and
# json.JSONDecodeError; OSError covers missing files; ImportError an optional package;
# VLLMBackendError a vLLM engine that is missing or cannot start.
BAD_INPUT = (ValueError, OSError, ImportError, KeyError, VLLMBackendError)


class ToolError(ValueError):
    """Bad input to a tool; the message says what to fix."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit code 2)."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, KeyError) and exc.args:
        text = str(exc.args[0])
    return text.splitlines()[0] if text else type(exc).__name__


def run_cli(prog: str, body: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser,
            argv: Optional[Sequence[str]]) -> int:
    """Parse ``argv`` and run ``body``; bad input is one line on stderr and exit code 2."""
    from ..train import quiet_libraries

    quiet_libraries()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:        # --help, or a one-line usage error: a code, not an exception
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    try:
        return body(args)
    except BAD_INPUT as exc:
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT


def resolve_device(name: str):
    from ..dist import resolve_device as resolve

    return resolve(name)


def check_model_src(src: str, what: str = "--model_name") -> bool:
    """Refuse a model path that cannot be a model, before anything loads; True if local."""
    local = os.path.isdir(src)
    if not local and (src.startswith((".", "/", "~")) or src.count("/") > 1 or os.path.exists(src)):
        raise ToolError(f"{what} {src}: no such model folder (give a folder with config.json or a hub id)")
    if local and not os.path.isfile(os.path.join(src, "config.json")):
        raise ToolError(f"{what} {src}: the folder holds no config.json, so it is not a model folder")
    return local


def load_model(src: str, device, *, what: str = "--model_name"):
    """(model, tokenizer) from a local folder or a hub id, in eval mode on ``device``
    (bf16 on CUDA, fp32 on CPU); a model that cannot be loaded is one ToolError."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    local = check_model_src(src, what)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        tok = AutoTokenizer.from_pretrained(src, local_files_only=local)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, local_files_only=local)
    except Exception as exc:  # transformers raises OSError, ValueError, hub errors...
        raise ToolError(f"{what} {src}: cannot load it ({type(exc).__name__}: {one_line(exc)[:160]}): "
                        f"give a local model folder or a reachable hub id") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.to(device).eval(), tok


def read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise ToolError(f"{what} {path} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ToolError(f"{what} {path} is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ToolError(f"{what} {path} is not a JSON object")
    return obj


def read_jsonl(path: str, what: str) -> List[dict]:
    """Objects of a JSON Lines file; a bad line is a ToolError naming its number."""
    if not os.path.isfile(path):
        raise ToolError(f"{what} {path} does not exist")
    out = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ToolError(f"{what} {path}: line {i} is not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ToolError(f"{what} {path}: line {i} is not a JSON object")
            out.append(obj)
    return out
