"""Train the chain's LoRA adapters by consensus ADMM.

usage: torchrun --nproc_per_node W -m admm_dist.train [--config FILE.yaml] [overrides ...]
       python -m admm_dist.train [--config FILE.yaml] [overrides ...]

Under torchrun the N ADMM nodes (one per adapted seat) are spread over the W <= N ranks in
contiguous blocks (one each with W = N; a rank with several nodes keeps one backbone and
switches their adapters, and hops between its nodes stay in memory); with plain python (or
--backend local) every node runs in this one process on one backbone. Where a node runs never
changes the numbers. Settings are layered: the defaults below, then the YAML file of --config
(configs/ has the paper's arms and small CPU versions), then overrides as --key value or
key=value (a bare --flag sets a boolean to true). An unknown key is refused with the closest
valid name. Bad input ends the run with one line on stderr and exit code 2; a run that cannot
go on (a peer rank stopped, the iterates diverged) with one line and exit code 1; Ctrl-C
(SIGINT) or SIGTERM with one line per rank and exit code 130 (143 for SIGTERM), the checkpoints
written so far kept for resume=auto. The process group is always torn down.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import List, Optional, Sequence

# Only light imports up here: the signal handlers are in place before torch and transformers
# load (seconds), so a Ctrl-C while a rank starts is one line too.
from admm_dist.engine.preemption import Interrupted, PreemptionFlag, StopSignals, signal_name

PROG = "admm_dist.train"


def _help() -> str:
    from admm_dist.core.text import plain
    from admm_dist.training.config import help_text

    return plain(__doc__) + "\nKeys, by group (meaning; choices; default):\n\n" + help_text()


class _Where:
    """What a stop's line names: this rank, and the run's ``out`` once the config is read."""

    def __init__(self) -> None:
        raw = os.environ.get("RANK", "0")
        self.rank = int(raw) if raw.isdigit() else 0
        self.out: Optional[str] = None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command; ``argv`` None: ``sys.argv``, and this process is the command's own (it
    then ends at once when the run is over, see :func:`_leave`)."""
    own = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    where = _Where()
    flag = PreemptionFlag()
    stop = StopSignals(on_deadline=lambda signum: _interrupted(signum, where, late=True))
    restore = flag.install()   # from the first line to the last write: USR2 never kills a worker
    unstop = lambda: None  # noqa: E731
    try:
        try:
            unstop = stop.install()   # Ctrl-C and SIGTERM: one line per rank, exit 128 + signal
            code = _run(argv, flag, stop, where)
        except KeyboardInterrupt as e:   # anywhere: while starting, or while another stop was reported
            stop.hold()
            code = _interrupted(getattr(e, "signum", signal.SIGINT), where)
        if own:
            _leave(code)
        return code
    finally:
        unstop()
        restore()


def _leave(code: int) -> None:
    """End the command's own process now, without the interpreter's finalization: everything
    is written and the process group destroyed by then. Finalization would cost twice:
    - an interrupted run's frames and reference cycles hold the group's sockets until the
      interpreter has finished exiting (seconds, with torch and transformers loaded), and a
      peer rank still waiting in a collective on this one would wait that long for its turn;
    - a gloo worker thread that drops its last tensor while the interpreter finalizes ends in
      ``std::terminate`` (SIGABRT, exit -6, about 1 CPU run in 20 before this), which turns a
      finished run into a failed worker for torchrun."""
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _run(argv: List[str], flag: PreemptionFlag, stop: StopSignals, where: _Where) -> int:
    from admm_dist.cli.common import emit

    if any(a in ("-h", "--help") for a in argv):
        emit(_help())
        return 0
    from torch.distributed import DistError

    from admm_dist.core import config_file
    from admm_dist.core.errors import EXIT_RUN_ERROR, EXIT_USER_ERROR, RunError, UserError
    from admm_dist.core.libraries import quiet_libraries
    from admm_dist.engine.dist import distributed, read_env
    from admm_dist.engine.preemption import Preempted, record_pid
    from admm_dist.testing import faults
    from admm_dist.training.config import TrainConfig
    from admm_dist.training.trainer import Trainer

    quiet_libraries()
    try:
        cfg = config_file.load(TrainConfig, argv)
        plan = faults.from_env()
    except UserError as e:
        stop.hold()
        _say(f"{PROG}: error: {e}")
        return EXIT_USER_ERROR
    where.out = cfg.out
    rank = 0
    unrecord = lambda: None  # noqa: E731
    interrupted = None
    try:
        rank = where.rank = read_env().rank
        unrecord = record_pid(rank)
        with distributed(cfg.device, timeout_s=cfg.timeout_s) as ctx:
            report = Trainer(cfg, ctx, preempt=flag, faults=plan).train()
            stop.hold()   # everything is written: a signal from now on does not make it "interrupted"
    except Interrupted as e:
        stop.hold()   # a second signal (torchrun's agent forwards the Ctrl-C) is only a note now
        interrupted = e.signum
    except Preempted as e:
        stop.hold()
        if rank == 0:
            print(f"{PROG}: {e}", flush=True)
            _quiet_status("preempted", e.round, cfg.out, str(e))
        return 0
    except (UserError, OSError, RunError, DistError) as e:
        stop.hold()
        msg = _one_line(e)
        _say(f"{PROG}: error on rank {rank}: {msg}")
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
    return _interrupted(interrupted, where)


def _interrupted(signum: int, where: _Where, late: bool = False) -> int:
    """The one line of a rank stopped by Ctrl-C or SIGTERM (rank 0 also writes the status);
    ``late``: said by the deadline thread, the main thread being stuck (see StopSignals)."""
    how = signal_name(signum)
    if where.out is None:
        msg = f"interrupted on rank {where.rank} ({how}) while starting: nothing was written; rerun"
    else:
        from admm_dist.training.checkpoint import all_rounds, ckpt_root

        root = ckpt_root(where.out)
        msg = (f"interrupted on rank {where.rank} ({how}): the last checkpoint in {root} is kept; "
               "rerun with resume=auto" if all_rounds(root) else
               f"interrupted on rank {where.rank} ({how}) before the first checkpoint: nothing to resume; "
               "rerun (resume=auto starts at round 0)")
    if late:
        msg += " (still busy after the signal: left without tearing down)"
    _say(f"{PROG}: {msg}")
    if where.rank == 0 and where.out is not None:
        _quiet_status("interrupted", None, where.out, msg)
    return 128 + signum


def _say(line: str) -> None:
    """``line`` on stderr in one write: the ranks share one terminal, unbuffered under torchrun,
    where ``print`` writes the text and its newline apart and two ranks' lines run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _one_line(e: BaseException) -> str:
    """An exception as one line; an OSError names the path and the reason."""
    from torch.distributed import DistError

    from admm_dist.core.errors import RunError, UserError

    if isinstance(e, OSError) and not isinstance(e, (UserError, RunError)):
        where = f" {e.filename}" if e.filename else ""
        return f"cannot use{where}: {e.strerror or e} (check the path, its permissions and free space)"
    if isinstance(e, DistError):
        return (f"the process group failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
                "a peer rank stopped or is unreachable; check every rank's log and the rendezvous address")
    return " ".join(str(e).split())


def _quiet_status(state: str, round_, out: str, message: str) -> None:
    from admm_dist.engine.preemption import write_status

    try:
        write_status(state, round_=round_, out=out, message=message)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
