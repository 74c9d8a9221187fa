"""Train the chain's LoRA adapters by consensus ADMM.

usage: torchrun --nproc_per_node N -m admm_dist.train [--config FILE.yaml] [overrides ...]
       python -m admm_dist.train [--config FILE.yaml] [overrides ...]

Under torchrun the ADMM nodes (one per adapted seat) are spread over the ranks, one each with
--nproc_per_node N; with plain python (or --backend local) every node runs in this one process
on one backbone. Settings are layered: the defaults below, then the YAML file of --config
(configs/ has the paper's arms and small CPU versions), then overrides as --key value or
key=value (a bare --flag sets a boolean to true). An unknown key is refused with the closest
valid name. Bad input ends the run with one line on stderr and exit code 2; a run that cannot
go on (a peer rank stopped, the iterates diverged) with one line and exit code 1; the process
group is always torn down.
"""
from __future__ import annotations

import sys
from typing import List, Optional, Sequence

from torch.distributed import DistError

from admm_dist.cli.common import emit
from admm_dist.core import config_file
from admm_dist.core.errors import EXIT_RUN_ERROR, EXIT_USER_ERROR, RunError, UserError
from admm_dist.core.libraries import quiet_libraries
from admm_dist.core.text import plain
from admm_dist.engine.dist import distributed, read_env
from admm_dist.engine.preemption import Preempted, PreemptionFlag, record_pid, write_status
from admm_dist.testing import faults
from admm_dist.training.config import TrainConfig, help_text
from admm_dist.training.trainer import Trainer

PROG = "admm_dist.train"
HELP = plain(__doc__) + "\nKeys, by group (meaning; choices; default):\n\n" + help_text()


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flag = PreemptionFlag()
    restore = flag.install()   # from the first line to the last write: USR2 never kills a worker
    try:
        return _run(argv, flag)
    finally:
        restore()


def _run(argv: List[str], flag: PreemptionFlag) -> int:
    quiet_libraries()
    if any(a in ("-h", "--help") for a in argv):
        emit(HELP)
        return 0
    try:
        cfg = config_file.load(TrainConfig, argv)
        plan = faults.from_env()
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    rank = 0
    unrecord = lambda: None  # noqa: E731
    try:
        rank = read_env().rank
        unrecord = record_pid(rank)
        with distributed(cfg.device, timeout_s=cfg.timeout_s) as ctx:
            report = Trainer(cfg, ctx, preempt=flag, faults=plan).train()
    except Preempted as e:
        if rank == 0:
            print(f"{PROG}: {e}", flush=True)
            _quiet_status("preempted", e.round, cfg.out, str(e))
        return 0
    except (UserError, OSError, RunError, DistError) as e:
        msg = _one_line(e)
        print(f"{PROG}: error on rank {rank}: {msg}", file=sys.stderr)
        if rank == 0:
            _quiet_status("failed", None, cfg.out, msg)
        return EXIT_USER_ERROR if isinstance(e, (UserError, OSError)) else EXIT_RUN_ERROR
    else:
        if rank == 0:
            if not cfg.quiet and not cfg.dry_run:
                print(f"done: {report.get('n_nodes')} node(s), delta_w_rel={report.get('delta_w_rel')}")
            _quiet_status("finished", cfg.k_outer, cfg.out, "done")
        return 0
    finally:
        unrecord()


def _one_line(e: BaseException) -> str:
    """An exception as one line; an OSError names the path and the reason."""
    if isinstance(e, OSError) and not isinstance(e, (UserError, RunError)):
        where = f" {e.filename}" if e.filename else ""
        return f"cannot use{where}: {e.strerror or e} (check the path, its permissions and free space)"
    if isinstance(e, DistError):
        return (f"the process group failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
                "a peer rank stopped or is unreachable; check every rank's log and the rendezvous address")
    return " ".join(str(e).split())


def _quiet_status(state: str, round_, out: str, message: str) -> None:
    try:
        write_status(state, round_=round_, out=out, message=message)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
