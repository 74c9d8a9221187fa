"""One error hierarchy for the whole package.

- :class:`AdmmDistError` is the base of every error ``admm_dist`` raises on purpose.
- :class:`UserError` is bad input: a setting, a file, a path, a missing optional package.
  Its message is one line that names the fix; every command prints it as
  ``<prog>: error: <message>`` and exits with :data:`EXIT_USER_ERROR` (2). It subclasses
  ``ValueError`` so that code catching ``ValueError`` around a check keeps working.
- :class:`RunError` is a run that could not go on although its input was good (a peer rank
  stopped, the iterates diverged, a sandbox is missing): one line too, exit code
  :data:`EXIT_RUN_ERROR` (1).
- :class:`admm_dist.engine.preemption.Preempted` (an :class:`AdmmDistError`) is not a failure:
  the run checkpointed and stopped on request.

Anything else (``KeyError``, ``TypeError``, a plain ``ValueError`` from a library) is a bug
and is left as a traceback. :func:`describe` is the one line a command says for an error.
"""
from __future__ import annotations

EXIT_USER_ERROR = 2
EXIT_RUN_ERROR = 1


class AdmmDistError(Exception):
    """Base class of every error ``admm_dist`` raises on purpose."""


class UserError(AdmmDistError, ValueError):
    """Bad input; the message is one line that says what to fix (exit code 2)."""


class ConfigError(UserError):
    """A configuration value or key is wrong; the message names the fix."""


class RunError(AdmmDistError, RuntimeError):
    """The run cannot go on although its input was valid (exit code 1)."""


def describe(exc: BaseException) -> str:
    """An error as the one line a command says: an ``OSError`` names its path and reason, any
    other error is its message with its white space folded."""
    if isinstance(exc, OSError) and not isinstance(exc, AdmmDistError):
        where = f" {exc.filename}" if exc.filename else ""
        return f"cannot use{where}: {exc.strerror or exc} (check the path, its permissions and free space)"
    return " ".join(str(exc).split())


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none)."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    text = text.strip()
    return text.splitlines()[0] if text else type(exc).__name__
