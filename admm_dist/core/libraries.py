"""Third-party libraries kept quiet: stderr is for our own one-line messages."""
from __future__ import annotations


def quiet_libraries() -> None:
    """No per-load progress bars, no transformers/peft deprecation chatter."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers|peft")
