"""``python -m admm_dist.evaluate``: the evaluation command (:mod:`admm_dist.cli.evaluate`)."""
import sys

from admm_dist.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
