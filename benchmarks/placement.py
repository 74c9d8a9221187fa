"""Placement benchmark: the same training run at world sizes W = 1, N and 2N, side by side, and
the memory a seat group's ranks hold at k = 1, 2, 4 ranks per seat, with and without sharding.

Run::

    python -m benchmarks.placement [--worlds 1,4,8] [--config FILE.yaml] [--out DIR]
                                        [--json PATH] [--timeout 1800] [--no-rounds]
                                        [--memory standin,smollm2] [--memory-ks 1,2,4] [key=value ...]

What it measures: what the number of ranks W costs or saves for one training run whose N
nodes (seats) are spread over W ranks in contiguous blocks (docs/placement.md), and that W
does not change the result. For every W of ``--worlds``, one after another (never two at once:
the figures are wall times), the training command of ``launch/cpu_demo.sh`` runs on
``--config`` (default the CPU default, ``configs/cpu/standin_onpolicy.yaml``: on-policy
collection, then consensus ADMM over a ring), with ``GLOO_SOCKET_IFNAME=lo`` and
``OMP_NUM_THREADS=1``:

- W = 1: ``python -m admm_dist.train --config FILE out=DIR/w1/run report_dir=DIR/w1/reports
  overwrite=true [key=value ...]``: plain python, every node in one process (no torchrun);
- W > 1: ``torchrun --standalone --nproc_per_node W -m admm_dist.train ...`` with the same
  arguments (``DIR/wW/...``), launched as ``python -m torch.distributed.run``.

The ``key=value`` arguments are overrides passed to every run (e.g. ``k_outer=2`` for a
shorter one); ``out=`` and ``report_dir=`` are the benchmark's own. Each run's output is kept
in ``DIR/wW/train.log``, and each run is bounded by ``--timeout`` seconds (then torchrun, or
the python process, gets SIGTERM and every process of the run left after 30 s SIGKILL, by PID).
A run that exits non-zero or runs past its bound stops the benchmark with one line naming W,
the exit status and the log, followed by the log's last lines; exit status 2.

Figures per W (one table row; all of them and more in ``--json``):

- ``wall_s``: wall time of the training command, interpreter start-up, model load, collection,
  rounds and final writes included (``time.perf_counter`` around the child process);
- ``train_s``: the report's ``train_sec`` (rank 0, from the trainer's construction to its
  results: without interpreter start-up and imports);
- ``collect_s``: the seconds of every on-policy collection, summed (the report's
  ``collections[*].seconds``, rank 0's clock); absent for a run from a fit-set file;
- ``round_s``: mean over the ADMM rounds of the round's time, each round's being the largest
  over nodes of ``sec_x + sec_z + sec_other`` of the report's ``rounds`` (x-steps of a rank's
  block one after another, the consensus, the dual update and the round's telemetry; not
  checkpoints or evaluation); ``x_s`` and ``z_s`` are the same means of the largest ``sec_x``
  (a rank's whole block) and ``sec_z`` (the consensus, waits for slower ranks included);
- ``wire_B/round`` and ``inproc_B/round``: bytes per round summed over nodes, mean over
  rounds: ``bytes_sent`` (the wire: gloo between ranks) and ``bytes_in_process`` (hops between
  two nodes of one rank, handed over in memory); the JSON has the run's totals too. At W = 1
  under plain python the run's communicator is the single-process one
  (``LocalCommunicator``), whose meter records as ``bytes_sent`` what each node *would* send
  in the distributed run: nothing crosses a wire, and the table marks that figure with ``*``
  (``wire_simulated`` in the JSON); under torchrun the same hops are ``bytes_in_process``;
- ``other_cores``: the mean number of cores processes other than the run kept busy meanwhile
  (:class:`admm_dist.bench.common.CpuWindow`): the machine's load, to read the times by;
- ``sha256`` of the result ``<out>-last.safetensors``: every tensor's raw bytes
  (``t.contiguous().view(torch.uint8)``), in sorted key order, hashed together (the file's
  bytes are not hashed: its metadata names paths). The last line says whether every W gave
  the same hash: placement must not change the numbers (docs/placement.md).

When a W of ``--worlds`` is k > 1 ranks per seat (W = k x N), every run gets ``micro_batches=K``
(K the largest such k) unless the overrides set it: a seat's k ranks share its minibatch's parts,
and every W must cut the minibatch alike to give the same bits. On a machine with fewer cores
than ranks, the W ranks of a run share the cores; the round times then say what the placement
costs in overhead, not what k devices would gain.

The memory table (``--memory``, after the runs; ``--no-rounds`` for it alone): for each model
(``standin``: assets/standin; ``smollm2``: assets/smollm2 once built, skipped with the command
that builds it otherwise; or a model folder) and each k of ``--memory-ks``, one seat group of k
ranks under torchrun loads the backbone through the trainer's loader, whole and, for k > 1,
sharded (:mod:`benchmarks.placement_memory`). Per rank, the largest over the group: the
backbone's and the adapter's parameter bytes held, the resident set before the model and once
the adapter is built, and the peak. The last lines say whether the backbone bytes per rank at
the largest k, sharded, are at most 0.30 of k = 1's.

``DIR`` (``--out``) is the scratch folder, its ``wW`` subfolders replaced on every invocation;
without ``--out`` a temporary folder is used and removed after a successful run (kept, and
named, after a failure). ``--json PATH`` writes the settings, the per-W figures and the
verdict, atomically.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

from admm_dist.bench.common import (Column, CpuWindow, descendants, format_rows, load_str, loadavg, num,
                                    write_json)
from benchmarks.placement_memory import DEFAULT_MEMORY, DEFAULT_MEMORY_KS, format_memory, run_memory
from admm_dist.core.errors import UserError

DEFAULT_CONFIG = "configs/cpu/standin_onpolicy.yaml"
DEFAULT_WORLDS = (1, 4, 8)          # one process, W = N and W = 2N for the CPU default's 4 seats
DEFAULT_TIMEOUT_S = 1800.0
RUN_NAME = "run"
OWN_KEYS = ("out", "report_dir")
STOP_GRACE_S = 30.0
TAIL_LINES = 15


class PlacementError(RuntimeError):
    """A run that failed or ran too long; the message is one line (the log's tail follows it)."""

    def __init__(self, line: str, tail: str = "") -> None:
        super().__init__(line)
        self.line, self.tail = line, tail


# --------------------------------------------------------------------------- one run
def command(world: int, config: str, folder: str, overrides: Sequence[str]) -> List[str]:
    """The training command of W = ``world`` ranks, its outputs in ``folder``."""
    args = ["--config", config, *overrides, f"out={os.path.join(folder, RUN_NAME)}",
            f"report_dir={os.path.join(folder, 'reports')}", "overwrite=true"]
    if world == 1:
        return [sys.executable, "-m", "admm_dist.train", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
            "-m", "admm_dist.train", *args]


def _stop(p: subprocess.Popen) -> None:
    """SIGTERM to the run's process (torchrun passes it to its workers), then SIGKILL to every
    process of the run still alive, by PID (torchrun's workers are in sessions of their own)."""
    left = descendants(p.pid)
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=STOP_GRACE_S)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _tail(path: str, n: int = TAIL_LINES) -> List[str]:
    with open(path, errors="replace") as fh:
        return [line.rstrip() for line in fh.readlines()[-n:] if line.strip()]


def _gist(log_path: str) -> str:
    """The log line that says what went wrong: the training command's own one-line error (the
    first rank's that does not only blame a peer), else the last Python exception line that is
    not torchrun's, else the log's last line."""
    with open(log_path, errors="replace") as fh:
        lines = [line.strip() for line in fh if line.strip() and not line.startswith("# ")]
    own = [line for line in lines if line.startswith("admm_dist.train: ")]
    if own:
        return next((line for line in own if "peer" not in line), own[0])
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b.*", line)
              and "ChildFailedError" not in line]
    if raised:
        return raised[-1]
    return lines[-1] if lines else "(no output)"


def launch(world: int, cmd: Sequence[str], log_path: str, timeout_s: float) -> Dict[str, Any]:
    """Run ``cmd`` with its output in ``log_path``; its wall time and the other processes' cores.
    Raises :class:`PlacementError` when it exits non-zero or runs past ``timeout_s``."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    window = CpuWindow.start()
    with open(log_path, "w") as log:
        log.write("# GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 " + " ".join(cmd) + "\n")
        log.flush()
        p = subprocess.Popen(list(cmd), env=env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
        try:
            rc: Optional[int] = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(p)
            rc = None
            log.write(f"\n# placement: ran past {timeout_s:.0f} s, stopped\n")
        except BaseException:        # Ctrl-C: the run goes too
            _stop(p)
            raise
    wall, other = window.stop()
    if rc != 0:
        tail = _tail(log_path)
        what = f"ran past --timeout {timeout_s:.0f} s and was stopped" if rc is None else f"exited {rc}"
        raise PlacementError(f"W={world}: the training command {what} after {wall:.1f} s: {_gist(log_path)} "
                             f"(log {log_path})", "\n".join(tail))
    return {"wall_s": round(wall, 2), "other_processes_cores": None if other is None else round(other, 3)}


def seat_overrides(worlds: Sequence[int], config: str, overrides: Sequence[str]) -> List[str]:
    """``micro_batches=K`` for every run when a W of ``worlds`` is K > 1 ranks per seat and the
    overrides set none: a seat's K ranks share its minibatch's K parts, and every W must split
    the minibatch alike for the runs to give the same bits (docs/placement.md)."""
    if any(o.split("=", 1)[0] == "micro_batches" for o in overrides):
        return []
    from admm_dist.core import config_file
    from admm_dist.training.config import TrainConfig

    try:
        n = config_file.load(TrainConfig, ["--config", config, *overrides]).n_nodes()
    except UserError:
        return []            # the first run says what is wrong, with its log
    ks = [w // n for w in worlds if w > n]
    return [f"micro_batches={max(ks)}"] if ks else []


# --------------------------------------------------------------------------- results
def tensors_sha256(path: str) -> Dict[str, Any]:
    """sha256 over the raw bytes of every tensor of a safetensors file, in sorted key order,
    and each tensor's dtype and shape."""
    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    tensors = load_file(path)
    layout = {}
    for k in sorted(tensors):
        t = tensors[k]
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        layout[k] = [str(t.dtype).replace("torch.", ""), list(t.shape)]
    return {"sha256": h.hexdigest(), "tensors": layout}


def _mean(xs: Sequence[float]) -> Optional[float]:
    return statistics.fmean(xs) if xs else None


def report_figures(report: Dict[str, Any]) -> Dict[str, Any]:
    """The timing and byte figures of one training report (``<name>-train.json``)."""
    rounds = report.get("rounds") or []
    per_round = [max(x + z + o for x, z, o in zip(r["sec_x"], r["sec_z"], r["sec_other"])) for r in rounds]
    wire = [sum(r["bytes_sent"]) for r in rounds]
    inproc = [sum(r.get("bytes_in_process") or []) for r in rounds]
    collections = report.get("collections") or []
    return {
        "rounds": len(rounds),
        "placement": report.get("placement"),
        "backend": report.get("backend"),
        "train_s": report.get("train_sec"),
        "collections": len(collections),
        "collect_s": round(sum(c.get("seconds", 0.0) for c in collections), 2) if collections else None,
        "round_s": _mean(per_round),
        "round_s_each": per_round,
        "x_s": _mean([max(r["sec_x"]) for r in rounds]),
        "z_s": _mean([max(r["sec_z"]) for r in rounds]),
        "wire_bytes_per_round": _mean(wire),
        "in_process_bytes_per_round": _mean(inproc),
        "wire_bytes_total": sum(wire),
        "wire_bytes_recv_total": sum(sum(r["bytes_recv"]) for r in rounds),
        "in_process_bytes_total": sum(inproc),
        "wire_simulated": report.get("backend") == "LocalCommunicator",
        "delta_w_rel": report.get("delta_w_rel"),
    }


def run_world(world: int, config: str, out: str, overrides: Sequence[str],
              timeout_s: float) -> Dict[str, Any]:
    """One W: a fresh ``out/wW``, the run, its report's figures and its result's hash."""
    import json

    folder = os.path.join(out, f"w{world}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    cmd = command(world, config, folder, overrides)
    rec: Dict[str, Any] = {"world": world, "launcher": "python" if world == 1 else "torchrun",
                           "folder": folder, "log": os.path.join(folder, "train.log")}
    rec.update(launch(world, cmd, rec["log"], timeout_s))
    report_path = os.path.join(folder, "reports", f"{RUN_NAME}-train.json")
    last = os.path.join(folder, f"{RUN_NAME}-last.safetensors")
    for path in (report_path, last):
        if not os.path.isfile(path):
            raise PlacementError(f"W={world}: the training command exited 0 but wrote no {path} "
                                 f"(log {rec['log']})", "\n".join(_tail(rec["log"])))
    with open(report_path) as fh:
        rec.update(report_figures(json.load(fh)))
    rec.update(tensors_sha256(last))
    rec["report"], rec["last"] = report_path, last
    return rec


# --------------------------------------------------------------------------- the whole run
def run(worlds: Sequence[int], *, config: str = DEFAULT_CONFIG, out: str, overrides: Sequence[str] = (),
        timeout_s: float = DEFAULT_TIMEOUT_S, log=print) -> Dict[str, Any]:
    """Every W one after another; returns {"settings", "runs", "same_sha256", "sha256", "load"}."""
    load_before = loadavg()
    whole = CpuWindow.start()
    os.makedirs(out, exist_ok=True)
    runs = []
    for w in worlds:
        log(f"# W={w}: {' '.join(command(w, config, os.path.join(out, f'w{w}'), overrides))}")
        r = run_world(w, config, out, overrides, timeout_s)
        log(f"# W={w}: done in {r['wall_s']:.1f} s, {r['rounds']} rounds, blocks {_blocks(r['placement'])}, "
            f"sha256 {r['sha256'][:16]}")
        runs.append(r)
    wall, other = whole.stop()
    hashes = sorted({r["sha256"] for r in runs})
    return {"settings": {"worlds": list(worlds), "config": config, "overrides": list(overrides), "out": out,
                         "timeout_s": timeout_s, "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
                         "commands": {str(w): command(w, config, os.path.join(out, f"w{w}"), overrides)
                                      for w in worlds}},
            "runs": runs, "same_sha256": len(hashes) == 1, "sha256": hashes[0] if len(hashes) == 1 else None,
            "load": {"loadavg_1min_before": load_before, "loadavg_1min_after": loadavg(),
                     "wall_s": round(wall, 1), "cpu_cores": os.cpu_count(), "other_processes_cores": other}}


def _blocks(placement: Optional[Sequence[Sequence[int]]]) -> str:
    """Nodes per rank (W <= N), or the ranks per seat of seat groups (W = k x N)."""
    if not placement:
        return "?"
    seats = [n for b in placement for n in b]
    if len(seats) > len(set(seats)):
        return f"{len(seats) // len(set(seats))}/seat"
    return ",".join(str(len(b)) for b in placement)


COLUMNS = (
    Column("W", 2, lambda r: str(r["world"])),
    Column("launcher", 8, lambda r: r["launcher"], "<"),
    Column("blocks", 8, lambda r: _blocks(r["placement"]), "<"),
    Column("wall s", 8, lambda r: num(r["wall_s"], ".1f")),
    Column("train s", 8, lambda r: num(r["train_s"], ".1f")),
    Column("collect s", 9, lambda r: num(r["collect_s"], ".1f")),
    Column("rounds", 6, lambda r: str(r["rounds"])),
    Column("round s", 8, lambda r: num(r["round_s"], ".3f")),
    Column("x s", 7, lambda r: num(r["x_s"], ".3f")),
    Column("z s", 7, lambda r: num(r["z_s"], ".3f")),
    Column("wire B/round", 13,
           lambda r: num(r["wire_bytes_per_round"], ",.0f") + ("*" if r["wire_simulated"] else "")),
    Column("inproc B/round", 14, lambda r: num(r["in_process_bytes_per_round"], ",.0f")),
    Column("other cores", 11, lambda r: num(r["other_processes_cores"], ".2f")),
    Column("sha256 of -last tensors", 0, lambda r: str(r["sha256"]), "<", sep="  "),
)


def format_table(runs: Sequence[Dict[str, Any]]) -> str:
    """One row per W; times in seconds, bytes per round summed over nodes."""
    lines = format_rows(COLUMNS, runs)
    lines.append("times in s: wall of the command; train = the report's train_sec; collect = on-policy "
                 "collection; round = mean over rounds of the slowest node's x + z + other (x: a rank's "
                 "block of x-steps, z: the consensus); bytes summed over nodes")
    if any(r["wire_simulated"] for r in runs):
        lines.append("* single-process run: the bytes each node would send in the distributed run (no wire)")
    return "\n".join(lines)


def _worlds(text: str) -> List[int]:
    try:
        ws = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write world sizes as integers, e.g. 1,2,4") from None
    if not ws or any(w < 1 for w in ws) or len(set(ws)) != len(ws):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct world sizes of at least 1, e.g. 1,2,4")
    return ws


def _names(text: str) -> List[str]:
    return [] if text.strip() == "none" else [x.strip() for x in text.split(",") if x.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.placement", description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=_worlds, default=list(DEFAULT_WORLDS),
                    help="world sizes W, comma-separated, run in this order (default 1,2,4)")
    ap.add_argument("--config", default=DEFAULT_CONFIG, help=f"training config (default {DEFAULT_CONFIG})")
    ap.add_argument("--out", metavar="DIR", default=None,
                    help="scratch folder, one subfolder wW per W "
                         "(default: a temporary folder, removed after)")
    ap.add_argument("--json", metavar="PATH",
                    help="write the settings and the figures here (a JSON dict), atomically")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help=f"seconds one training command may take (default {DEFAULT_TIMEOUT_S:.0f})")
    ap.add_argument("--no-rounds", action="store_true", help="skip the training runs (the memory table only)")
    ap.add_argument("--memory", type=_names, default=list(DEFAULT_MEMORY),
                    help="models of the memory table: standin, smollm2 or a model folder, comma-separated; "
                         "none to skip it (default standin,smollm2; smollm2 only once built)")
    ap.add_argument("--memory-ks", type=_worlds, default=list(DEFAULT_MEMORY_KS),
                    help="ranks per seat of the memory table (default 1,2,4; 1 is the reference)")
    ap.add_argument("overrides", nargs="*", metavar="key=value",
                    help="overrides passed to every training command")
    a = ap.parse_args(argv)
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        ap.error(f"override {bad[0]!r}: write key=value (e.g. k_outer=2)")
    own = [o for o in a.overrides if o.split("=", 1)[0].lstrip("-") in OWN_KEYS]
    if own:
        ap.error(f"override {own[0]!r}: out= and report_dir= are the benchmark's (use --out DIR)")
    if not os.path.isfile(a.config):
        ap.error(f"--config {a.config} does not exist: pass a file from configs/ "
                 "(run from the repository root)")
    if a.timeout <= 0:
        ap.error("--timeout must be positive")
    if 1 not in a.memory_ks and a.memory:
        ap.error("--memory-ks must include 1: the table compares every k with one rank per seat")
    out = a.out or tempfile.mkdtemp(prefix="placement-")
    log = lambda *x: print(*x, flush=True)   # noqa: E731
    overrides = list(a.overrides) + seat_overrides(a.worlds, a.config, a.overrides)
    r: Dict[str, Any] = {"runs": [], "same_sha256": True}
    try:
        if not a.no_rounds:
            print(f"# placement benchmark: {a.config} at W = {','.join(map(str, a.worlds))}, one after "
                  "another" + (f"; overrides {' '.join(overrides)}" if overrides else "")
                  + f"; runs in {out}", flush=True)
            print(f"# load average (1/5/15 min) before: {load_str()}; on {os.cpu_count()} cores the W ranks "
                  f"of a run share them", flush=True)
            r = run(a.worlds, config=a.config, out=out, overrides=overrides, timeout_s=a.timeout, log=log)
        memory = run_memory(a.memory, a.memory_ks, config=a.config, out=out, timeout_s=a.timeout,
                            launch=launch, log=log)
    except PlacementError as e:
        print(f"placement: error: {e.line}", file=sys.stderr)
        if e.tail:
            print("".join(f"#   {line}\n" for line in e.tail.splitlines()), end="", file=sys.stderr)
        return 2
    if not a.no_rounds:
        print(format_table(r["runs"]))
        print("sha256 of the -last tensors: "
              + (f"the same at every W ({r['sha256']})" if r["same_sha256"] else
                 "DIFFERS between W: " + ", ".join(f"W={x['world']} {x['sha256'][:16]}" for x in r["runs"])))
        load = r["load"]
        print(f"# load average (1/5/15 min) after the runs: {load_str()}; wall {load['wall_s']:.1f} s on "
              f"{load['cpu_cores']} cores; other processes used about "
              f"{num(load['other_processes_cores'], '.2f')} cores on average")
        r["settings"]["out_kept"] = a.out is not None     # the temporary folder (paths in runs) is removed
    r["memory"] = memory
    if memory:
        print(format_memory(memory))
    if a.json:
        write_json(a.json, r)
    if a.out is None:
        shutil.rmtree(out, ignore_errors=True)
    return 0 if r["same_sha256"] else 1


if __name__ == "__main__":
    sys.exit(main())
