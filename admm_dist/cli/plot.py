"""``python -m admm_dist.plot INPUT.json [INPUT.json ...] --out DIR``: PNGs of finished runs.

Each input is recognised by its content (:mod:`admm_dist.plots.series`):

- a training report ``<name>-train.json`` -> ``<name>-objectives.png``, ``<name>-residuals.png``,
  ``<name>-bytes.png``; two or more -> also ``compare-residuals.png``, ``compare-objectives.png``;
- evaluation results (``python -m admm_dist.evaluate --json``) -> ``accuracy.png``, one bar each;
- a benchmark summary (``docs/bench_fidelity.json``) -> ``accuracy-by-arm.png``.

What draws them is :mod:`admm_dist.plots.figures` (imported only here, when the command runs:
it loads matplotlib). One line is printed per file written.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from admm_dist.cli.common import OneLineParser, run_cli

PROG = "python -m admm_dist.plot"


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("inputs", nargs="+", metavar="INPUT.json",
                   help="a training report (<name>-train.json), an evaluation result "
                        "(evaluate --json) or a benchmark summary (docs/bench_fidelity.json)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder for the PNGs (created if missing; files there of the same name "
                        "are replaced)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _run, _parser(), argv)


def _run(args: argparse.Namespace) -> int:
    # loads matplotlib: only when the command runs
    from admm_dist.plots.figures import draw_all

    for path in draw_all(args.inputs, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
