"""``python -m admm_dist.plan``: a GPU job rehearsed on CPU before it runs (:mod:`admm_dist.cli.plan`)."""
import sys

from admm_dist.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
