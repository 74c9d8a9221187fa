"""Third-party libraries: kept quiet (stderr is for our own one-line messages), and the one test of
whether the optional vLLM is here."""
from __future__ import annotations

import importlib.util


def quiet_libraries() -> None:
    """No per-load progress bars, no transformers/peft deprecation chatter."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers|peft")


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (without importing it: a broken install fails at engine start)."""
    return importlib.util.find_spec("vllm") is not None
