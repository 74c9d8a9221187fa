"""Train the chain's LoRA adapters by consensus ADMM.

usage: torchrun --nproc_per_node W -m admm_dist.train [--config FILE.yaml] [overrides ...]
       python -m admm_dist.train [--config FILE.yaml] [overrides ...]

Under torchrun the N ADMM nodes (one per adapted seat) are spread over the W ranks: with
W <= N in contiguous blocks (one each with W = N; a rank with several nodes keeps one backbone
and switches their adapters, and hops between its nodes stay in memory), with W = k x N as seat
groups of k ranks per node (its x-steps data-parallel over micro_batches; shard_backbone=true
shards its backbone over them); with plain python (or --backend local) every node runs in this
one process on one backbone. Where a node runs never changes the numbers.
Settings are layered: the defaults below, then the YAML file of --config
(configs/ has the paper's arms and small CPU versions), then overrides as --key value or
key=value (a bare --flag sets a boolean to true). An unknown key is refused with the closest
valid name. Bad input ends the run with one line on stderr and exit code 2; a run that cannot
go on (a peer rank stopped, the iterates diverged) with one line and exit code 1, which names
the rank that stopped answering where a roll call of the ranks tells it. Under torchrun a
failure is said once per job, by the rank that meets it first: a failure every rank meets alike
is not repeated, and the workers torchrun's agent then stops (SIGTERM) say nothing; torchrun
itself exits 1 after its own summary of the workers' exit codes. Ctrl-C (SIGINT) or SIGTERM
with one line per rank and exit code 130 (143 for SIGTERM), the checkpoints written so far kept
for resume=auto. The process group is always torn down.
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
    """What a stop's line names: this rank, and the run's ``out`` once the config is read; and
    whether torchrun's agent started this worker (it SIGTERMs every other worker once one fails)."""

    def __init__(self) -> None:
        raw = os.environ.get("RANK", "0")
        self.rank = int(raw) if raw.isdigit() else 0
        self.out: Optional[str] = None
        self.agent = "TORCHELASTIC_RUN_ID" in os.environ


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
            code = _run(argv, flag, stop, where, own)
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


def _run(argv: List[str], flag: PreemptionFlag, stop: StopSignals, where: _Where, own: bool) -> int:
    import gc

    from admm_dist.cli.common import emit

    if any(a in ("-h", "--help") for a in argv):
        emit(_help())
        return 0
    from torch.distributed import DistError

    from admm_dist.core import config_file
    from admm_dist.core.errors import RunError, UserError
    from admm_dist.core.libraries import quiet_libraries
    from admm_dist.engine.dist import distributed
    from admm_dist.engine.env import read_env
    from admm_dist.engine.preemption import Preempted, record_pid
    from admm_dist.training.config import TrainConfig
    from admm_dist.training.memory_plan import check_before_loading
    from admm_dist.training.trainer import Trainer

    quiet_libraries()
    if own:
        # as a forked worker does (admm_dist/training/workers.py, adopt): the imports are never
        # garbage, and the collector's full passes over them are pauses no other rank shares
        gc.freeze()
    try:
        cfg = config_file.load(TrainConfig, argv)
    except UserError as e:   # every rank finds it alike: said by the first, once per job
        stop.hold()
        return _failed(e, where, None, f"{PROG}: error: ")
    where.out = cfg.out
    rank = 0
    unrecord = lambda: None  # noqa: E731
    interrupted = None
    ctx = None
    try:
        env = read_env()
        rank = where.rank = env.rank
        unrecord = record_pid(rank)
        # before any weights are read or any GPU memory is taken: will this rank fit its device?
        check_before_loading(cfg, argv, env, log=print)
        with distributed(cfg.device, timeout_s=cfg.timeout_s) as ctx:
            report = Trainer(cfg, ctx, preempt=flag).train()
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
        return _failed(e, where, ctx.roll_call if ctx is not None else None,
                       f"{PROG}: error on rank {rank}: ")
    else:
        if rank == 0:
            if not cfg.quiet and not cfg.dry_run:
                dw = report.get("delta_w_rel")
                print(f"done: {report.get('n_nodes')} node(s); training moved the adapted weights by "
                      f"delta_w_rel = ||dW|| / ||W|| = {dw if isinstance(dw, list) else f'{dw:.3g}'}")
            _quiet_status("finished", cfg.k_outer, cfg.out, "done")
        return 0
    finally:
        unrecord()
    return _interrupted(interrupted, where)


def _failed(e: BaseException, where: _Where, roll_call, prefix: str) -> int:
    """The line of a run that failed with ``e``, said once per job
    (:class:`~admm_dist.engine.job.FirstFailure`): by the rank that fails first. A later rank
    says nothing when its message is the first one's (bad input every rank finds alike) or when
    it lost a peer (the first line says why); another problem of its own is still said. The
    first line of a lost peer names the rank that went away, where the ranks' ``roll_call``
    tells it. Rank 0 writes the status. The exit code (2 or 1)."""
    from torch.distributed import DistError

    from admm_dist.core.errors import EXIT_RUN_ERROR, EXIT_USER_ERROR, UserError
    from admm_dist.engine.comm.communicator import CommError
    from admm_dist.engine.job import FirstFailure

    lost = isinstance(e, (CommError, DistError))
    msg = _one_line(e)
    failures = FirstFailure(_job_env())
    first = failures.claim(msg)   # this rank's already when distributed() claimed it on the way out
    if first is None:
        gone = roll_call.silent() if lost and roll_call is not None else []
        if gone:
            msg += f"; rank {', '.join(map(str, gone))} stopped answering (killed, stopped or cut off)"
            failures.amend(msg)
    shown = msg.removeprefix(f"rank {where.rank}: ")   # the line names the rank
    if first is None or (not lost and first[1] != msg):
        _say(prefix + shown)
    if where.rank == 0 and where.out is not None:
        _quiet_status("failed", None, where.out, shown if first is None else _on_rank(*first))
    return EXIT_USER_ERROR if isinstance(e, (UserError, OSError)) else EXIT_RUN_ERROR


def _on_rank(rank: int, message: str) -> str:
    """Another rank's failure, as rank 0's status says it."""
    return f"error on rank {rank}: " + message.removeprefix(f"rank {rank}: ")


def _job_env():
    """This worker's place in the job, or None where the environment is itself the error."""
    from admm_dist.engine.env import DistConfigError, read_env

    try:
        return read_env()
    except DistConfigError:
        return None


def _interrupted(signum: int, where: _Where, late: bool = False) -> int:
    """The one line of a rank stopped by Ctrl-C or SIGTERM (rank 0 also writes the status);
    ``late``: said by the deadline thread, the main thread being stuck (see StopSignals).
    Nothing is said for a SIGTERM of torchrun's agent that follows another worker's failure:
    while starting (the agent's own summary names the worker), or once a rank has said the
    job's first failure (:func:`_failed`), which rank 0 then writes as the status."""
    how = signal_name(signum)
    if signum == signal.SIGTERM and where.agent:
        if where.out is None:
            return 128 + signum
        from admm_dist.engine.job import FirstFailure

        first = FirstFailure(_job_env()).recorded()
        if first is not None:
            if where.rank == 0:
                _quiet_status("failed", None, where.out, _on_rank(*first))
            return 128 + signum
    if where.out is None:
        msg = f"interrupted on rank {where.rank} ({how}) while starting: nothing was written"
    else:
        from admm_dist.training.checkpoint import all_rounds, ckpt_root

        root = ckpt_root(where.out)
        msg = (f"interrupted on rank {where.rank} ({how}): the last checkpoint in {root} is kept; "
               "rerun with resume=auto" if all_rounds(root) else
               f"interrupted on rank {where.rank} ({how}) before the first checkpoint: nothing to resume "
               "(resume=auto starts at round 0)")
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
    """An exception as one line (:func:`~admm_dist.core.errors.describe`; a DistError's C++ text cut
    to its cause)."""
    from torch.distributed import DistError

    from admm_dist.core.errors import describe
    from admm_dist.engine.comm.communicator import first_line

    if isinstance(e, DistError):
        return (f"the process group failed ({type(e).__name__}: {first_line(e)}): "
                "a peer rank stopped or is unreachable; check every rank's log and the rendezvous address")
    return describe(e)


def _quiet_status(state: str, round_, out: str, message: str) -> None:
    from admm_dist.engine.preemption import write_status

    try:
        write_status(state, round_=round_, out=out, message=message)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
