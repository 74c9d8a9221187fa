"""``python -m admm_dist.cli.pretrained NAME [--out DIR]``: build a packaged pretrained model's
folder offline (:mod:`admm_dist.model.pretrained`)."""
from __future__ import annotations

import sys

from admm_dist.cli.common import OneLineParser
from admm_dist.model import pretrained


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m admm_dist.cli.pretrained",
                       description=pretrained.__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(pretrained.MODELS), help="which packaged model")
    ap.add_argument("--out", default=None, help="the model folder to write (default: assets/<model>)")
    a = ap.parse_args(argv)
    try:
        pretrained.build(a.model, a.out or pretrained.spec(a.model).folder)
    except (pretrained.PretrainedError, OSError) as exc:
        print(f"admm_dist.cli.pretrained: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
