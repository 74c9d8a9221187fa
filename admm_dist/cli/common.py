"""What every command shares: a parser whose errors are one line and whose help is plain text, a
``main`` wrapper that turns a :class:`~admm_dist.core.errors.UserError` (or a missing file, or a
missing optional package) into one line on stderr and exit code 2.

Real bugs are not caught here: they stay tracebacks.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional, Sequence

from admm_dist.core.errors import EXIT_USER_ERROR, UserError, one_line
from admm_dist.core.libraries import quiet_libraries
from admm_dist.core.text import plain

# What bad input raises: UserError (every check of ours), OSError (a missing or unwritable
# file), ImportError (an optional package that is not installed).
BAD_INPUT = (UserError, OSError, ImportError)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit code 2), and whose description
    and epilog (usually a docstring's paragraphs) are shown as plain text, without reST markup."""

    def __init__(self, *args, description: Optional[str] = None, epilog: Optional[str] = None, **kwargs):
        super().__init__(*args, description=description and plain(description),
                         epilog=epilog and plain(epilog), **kwargs)

    def print_help(self, file=None):
        if file is None:
            emit(self.format_help())
        else:
            super().print_help(file)

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message}\n")


def emit(text: str) -> None:
    """Write ``text`` (a help text) to stdout; a reader that stops early (``--help | head``) is
    not an error."""
    try:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:          # stdout to /dev/null, so that the exit's flush is quiet too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def run_cli(prog: str, body: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser,
            argv: Optional[Sequence[str]]) -> int:
    """Parse ``argv`` and run ``body``; bad input is one line on stderr and exit code 2."""
    quiet_libraries()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:        # --help, or a one-line usage error: a code, not an exception
        return exc.code if isinstance(exc.code, int) else EXIT_USER_ERROR
    try:
        return body(args)
    except BAD_INPUT as exc:
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
