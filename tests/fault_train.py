"""The training command with a planned fault: ``python -m tests.fault_train ARGS`` (or
``torchrun ... -m tests.fault_train ARGS``) is ``python -m admm_dist.train ARGS`` with the plan of
``ADMM_DIST_FAULT_AT`` (:mod:`tests.faults`) armed in this process first. Run from the repository
root, or with it on ``PYTHONPATH``: the tests and ``benchmarks/kill_resume.py`` start it."""
import sys

from admm_dist.core.errors import UserError
from tests import faults


def main() -> int:
    try:
        plan = faults.from_env()
    except UserError as e:   # a malformed plan: the command's one line and exit code
        print(f"admm_dist.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    faults.install(plan)
    from admm_dist.cli import train
    return train.main()


if __name__ == "__main__":
    sys.exit(main())
