"""``python -m admm_dist.train``: the training command (:mod:`admm_dist.cli.train`)."""
import sys

from admm_dist.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
