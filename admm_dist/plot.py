"""``python -m admm_dist.plot``: the plot command (:mod:`admm_dist.cli.plot`)."""
import sys

from admm_dist.cli.plot import main

if __name__ == "__main__":
    sys.exit(main())
