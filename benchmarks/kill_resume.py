"""Kill one rank inside a checkpoint write, resume, and compare bit for bit with an uninterrupted run.

Run::

    python -m benchmarks.kill_resume [--runs 20] [--out DIR] [--seed 0] [--k-outer 5]
                                          [--nproc 4] [--json PATH] [--timeout 600]

What it measures: whether a run of 4 nodes under ``torchrun`` (CPU, gloo on loopback, one
thread per rank; ``--nproc`` ranks, 4 by default: one node per rank, fewer: contiguous blocks
of nodes per rank, :mod:`admm_dist.engine.placement`) whose rank is SIGKILLed at an
arbitrary moment of a checkpoint write, and which is then continued with ``resume=auto``,
ends with exactly the results of a run that was never interrupted, and leaves nothing behind.

1. Tiny offline assets in ``DIR/assets``: the random tiny Qwen3 of the tests
   (:func:`admm_dist.demo.tiny.save_tiny_backbone`) and a synthetic DPO fit set of 16
   examples per seat for a chain of 4 (:func:`admm_dist.demo.synthetic.write_fitset`), as
   the tests' ``tiny_assets(4)`` builds them.
2. One uninterrupted reference run per ``keep_checkpoints`` value (1 and 3), ``k_outer``
   rounds (default 5), a checkpoint every round, in ``DIR/ref-keepK``.
3. ``--runs`` trials (``DIR/run-NN``): trial i uses ``keep_checkpoints`` 1 for even i and 3
   for odd i, and draws (seeded by ``--seed``) a round in 1..k_outer, a node in 0..3 and a
   point of the write (:data:`tests.faults.POINTS`: before the tensors, with the
   tensors' temporary written but not renamed, between the tensors and the JSON marker, with
   the marker's temporary not renamed, right after the marker). The run is started with
   ``ADMM_DIST_FAULT_AT=ckpt@ROUND:NODE:POINT`` and ``--max-restarts 0``, each rank running
   ``-m tests.fault_train`` (the training command with that plan armed, :mod:`tests.faults`):
   the rank holding NODE kills itself (SIGKILL, by its own PID) there, and torchrun stops the others, so the
   launch must fail (``fault rc`` non-zero, the SIGKILL seen in torchrun's log on that rank,
   and on no other). Then the same command with ``resume=auto`` and no fault must exit 0.
4. The resumed run's ``-last`` vector (key ``b``) and every node file's tensors (x, z, u) are
   compared byte for byte with the reference of the same ``keep_checkpoints`` (same names,
   dtypes, shapes and bytes: NaN payloads and signed zeros included). It also records the
   round the resume continued after, whether any ``.tmp`` or ``.staged`` file is left under
   the trial's folder, and which round folders remain in ``<out>.ckpt`` (they should be the
   reference's: the newest ``keep_checkpoints`` rounds).

One line per trial (keep, round, node, point, both exit codes, resumed-after round, identical,
leftovers, rounds left, seconds) and a summary line ``N/N bit-identical``. The exit status is
1 if any trial's fault run did not fail by the kill, its resume failed, or its results differ
from the reference; ``--json PATH`` writes every trial and the summary there, atomically.
Each trial's two torchrun logs are kept in its folder (``fault.log``, ``resume.log``).

``DIR`` is the benchmark's scratch folder: its ``assets``, ``ref-keep*`` and ``run-*``
subfolders are replaced on every invocation.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from admm_dist.bench.common import descendants

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests.fault_train's root
N_AGENTS = 4     # nodes: one per seat of the chain
KEEPS = (1, 3)
DEFAULT_K_OUTER = 5
DEFAULT_TIMEOUT_S = 600.0


# --------------------------------------------------------------------------- assets and settings
def build_assets(folder: str) -> Dict[str, str]:
    """The tiny backbone and fit set of the tests' ``tiny_assets(4)``, in ``folder``."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from admm_dist.demo.synthetic import write_fitset
    from admm_dist.demo.tiny import save_tiny_backbone

    hf_logging.disable_progress_bar()
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    bb = save_tiny_backbone(os.path.join(folder, "backbone"), seed=1, hidden=32, layers=2, heads=2)
    settings = {"task": "synthetic", "n_agents": N_AGENTS, "adapt_roles": "all"}
    fit = write_fitset(os.path.join(folder, "dpo.jsonl"), settings=settings, per_seat=16,
                       tokenizer=AutoTokenizer.from_pretrained(bb))
    return {"backbone": bb, "fit": fit}


def train_args(assets: Dict[str, str], folder: str, *, keep: int, k_outer: int,
               resume: bool = False) -> List[str]:
    """The training command's ``key=value`` overrides: the tests' small run on 4 nodes."""
    d = dict(model_name=assets["backbone"], fitset_cache=assets["fit"], task="synthetic", n_agents=N_AGENTS,
             device="cpu", lora_rank=4, lora_alpha=8.0, lora_layers_last=2, k_outer=k_outer, local_steps=2,
             batch_size=4, eta=0.02, rho=0.1, grad_clip=1.0, timeout_s=30, quiet=False,
             checkpoint_every=1, keep_checkpoints=keep,
             out=os.path.join(folder, "runs", "run"), report_dir=os.path.join(folder, "reports"))
    if resume:
        d["resume"] = "auto"
    return [f"{k}={v}" for k, v in d.items()]


# --------------------------------------------------------------------------- one launch
def torchrun(args: Sequence[str], log_path: str, *, fault: Optional[str], timeout_s: float,
             nproc: int = N_AGENTS) -> int:
    """``torchrun --standalone --nproc_per_node NPROC --max-restarts 0 -m admm_dist.train ARGS``
    (with ``fault``: ``-m tests.fault_train``, the repository root on PYTHONPATH), its
    output in ``log_path``; the exit status (124 when it ran past ``timeout_s``: torchrun gets
    SIGTERM, which it passes to its workers, then every process left gets SIGKILL by PID)."""
    from tests import faults

    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.pop(faults.ENV, None)
    if fault:
        env[faults.ENV] = fault
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--max-restarts", "0", "-m", "tests.fault_train" if fault else "admm_dist.train", *args]
    with open(log_path, "w") as log:
        log.write("# " + (f"{faults.ENV}={fault} " if fault else "") + " ".join(cmd) + "\n")
        log.flush()
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            return p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            left = descendants(p.pid)
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            log.write(f"\n# kill_resume: ran past {timeout_s:.0f} s, stopped\n")
            return 124


def _tail(path: str, n: int = 30) -> str:
    with open(path, errors="replace") as fh:
        return "".join(fh.readlines()[-n:])


# --------------------------------------------------------------------------- results
def result_tensors(folder: str) -> Dict[str, Dict[str, tuple]]:
    """Every result tensor of the run in ``folder`` as (dtype, shape, raw bytes): the ``-last``
    file's and each node file's (missing files are absent)."""
    import torch
    from safetensors.torch import load_file

    runs = os.path.join(folder, "runs")
    files = {"last": os.path.join(runs, "run-last.safetensors")}
    files.update({f"node-{i}": os.path.join(runs, "run", f"node-{i}.safetensors") for i in range(N_AGENTS)})
    out: Dict[str, Dict[str, tuple]] = {}
    for name, path in files.items():
        if os.path.exists(path):
            out[name] = {k: (str(t.dtype), tuple(t.shape),
                             t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                         for k, t in load_file(path).items()}
    return out


def differences(got: Dict[str, Dict[str, tuple]], ref: Dict[str, Dict[str, tuple]]) -> List[str]:
    """What differs between two runs' result tensors ([] when bit-identical)."""
    diff = []
    for name in sorted(set(ref) | set(got)):
        if name not in got:
            diff.append(f"{name}: missing")
            continue
        if name not in ref:
            diff.append(f"{name}: not in the reference")
            continue
        for key in sorted(set(ref[name]) | set(got[name])):
            a, b = got[name].get(key), ref[name].get(key)
            if a != b:
                diff.append(f"{name}[{key}]: "
                            + ("missing" if a is None else "extra" if b is None else "differs"))
    if "last" in ref and ref["last"].get("b") is None:
        diff.append("reference has no -last vector 'b'")
    return diff


def leftovers(folder: str) -> List[str]:
    """Temporaries (``*.tmp``) and staged results (``.*.staged*``) anywhere under ``folder``."""
    out = []
    for d, dirs, files in os.walk(folder):
        for name in dirs + files:
            if name.endswith(".tmp") or ".staged" in name:
                out.append(os.path.relpath(os.path.join(d, name), folder))
    return sorted(out)


def rounds_left(folder: str) -> List[int]:
    root = os.path.join(folder, "runs", "run.ckpt")
    if not os.path.isdir(root):
        return []
    return sorted(int(n.split("-", 1)[1]) for n in os.listdir(root) if n.startswith("round-"))


def resumed_after(log_path: str) -> Optional[int]:
    """The round the resume continued after (0: from the start), from rank 0's log line."""
    with open(log_path, errors="replace") as fh:
        for line in fh:
            if "resume auto: continuing after round " in line:
                return int(line.split("continuing after round ", 1)[1].split(";")[0].split()[0])
            if "resume auto: no complete checkpoint" in line:
                return 0
    return None


def killed_ranks(log_path: str) -> List[int]:
    """The local ranks torchrun reported ended by SIGKILL: the planned fault fired on the rank
    holding the node (:func:`admm_dist.engine.placement.owners`). torchrun names its first
    observed failure in one line (``failed (exitcode: -9) local_rank: R``) and every failed rank
    in its summary (``local_rank: R)`` then ``exitcode  : -9``); the killed rank need not be the
    first observed, since its peers fail within milliseconds of it."""
    out = []
    rank = None
    with open(log_path, errors="replace") as fh:
        for line in fh:
            if "(exitcode: -9) local_rank: " in line:
                out.append(int(line.split("(exitcode: -9) local_rank: ", 1)[1].split()[0]))
            m = re.search(r"\(local_rank: (\d+)\)", line)
            if m:
                rank = int(m.group(1))
            elif rank is not None and re.match(r"\s*exitcode\s*: -9\b", line):
                out.append(rank)
                rank = None
    return sorted(set(out))


# --------------------------------------------------------------------------- the loop
def plan(runs: int, seed: int, k_outer: int) -> List[Dict[str, object]]:
    from tests.faults import POINTS

    rng = random.Random(seed)
    return [{"keep": KEEPS[i % len(KEEPS)], "round": rng.randint(1, k_outer), "node": rng.randrange(N_AGENTS),
             "point": rng.choice(POINTS)} for i in range(runs)]


def run(out: str, runs: int, *, seed: int = 0, k_outer: int = DEFAULT_K_OUTER,
        timeout_s: float = DEFAULT_TIMEOUT_S, nproc: int = N_AGENTS, log=print) -> Dict[str, object]:
    """The whole benchmark; returns {"settings", "references", "trials", "summary"}."""
    from admm_dist.engine.placement import owners

    owner = owners(N_AGENTS, nproc)
    t_all = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        if name == "assets" or name.startswith(("ref-keep", "run-")):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    assets = build_assets(os.path.join(out, "assets"))
    keeps = sorted({KEEPS[i % len(KEEPS)] for i in range(runs)})
    refs, references = {}, {}
    for keep in keeps:
        folder = os.path.join(out, f"ref-keep{keep}")
        os.makedirs(folder)
        t0 = time.perf_counter()
        rc = torchrun(train_args(assets, folder, keep=keep, k_outer=k_outer),
                      os.path.join(folder, "train.log"), fault=None, timeout_s=timeout_s, nproc=nproc)
        secs = time.perf_counter() - t0
        refs[keep] = result_tensors(folder)
        references[keep] = {"rc": rc, "seconds": round(secs, 1), "rounds_left": rounds_left(folder),
                            "leftovers": leftovers(folder)}
        log(f"# reference keep_checkpoints={keep}: rc {rc}, rounds left {references[keep]['rounds_left']}, "
            f"{secs:.1f} s")
        if rc != 0 or "last" not in refs[keep]:
            raise RuntimeError(f"the uninterrupted reference run (keep_checkpoints={keep}) failed with "
                               f"rc {rc}; its log ({folder}/train.log) ends:\n"
                               f"{_tail(os.path.join(folder, 'train.log'))}")
    log(f"{'run':>3} {'keep':>4} {'round':>5} {'node':>4} {'point':<16} {'fault rc':>8} {'resume rc':>9} "
        f"{'after':>5} {'identical':>9} {'leftovers':>9} {'rounds left':<12} {'s':>6}")
    trials = []
    for i, p in enumerate(plan(runs, seed, k_outer)):
        folder = os.path.join(out, f"run-{i:02d}")
        os.makedirs(folder)
        fault = f"ckpt@{p['round']}:{p['node']}:{p['point']}"
        t0 = time.perf_counter()
        flog, rlog = os.path.join(folder, "fault.log"), os.path.join(folder, "resume.log")
        frc = torchrun(train_args(assets, folder, keep=p["keep"], k_outer=k_outer), flog, fault=fault,
                       timeout_s=timeout_s, nproc=nproc)
        fired = killed_ranks(flog)
        rounds_after_kill = rounds_left(folder)
        rrc = torchrun(train_args(assets, folder, keep=p["keep"], k_outer=k_outer, resume=True), rlog,
                       fault=None, timeout_s=timeout_s, nproc=nproc)
        secs = time.perf_counter() - t0
        diff = differences(result_tensors(folder), refs[p["keep"]]) if rrc == 0 else ["resume failed"]
        t = dict(p, run=i, rank=owner[p["node"]], fault=fault, fault_rc=frc, killed_ranks=fired,
                 kill_fired=fired == [owner[p["node"]]],
                 rounds_after_kill=rounds_after_kill,
                 resume_rc=rrc, resumed_after=resumed_after(rlog), identical=not diff, differences=diff,
                 leftovers=leftovers(folder), rounds_left=rounds_left(folder),
                 rounds_as_reference=rounds_left(folder) == references[p["keep"]]["rounds_left"],
                 seconds=round(secs, 1), folder=folder)
        t["ok"] = bool(frc != 0 and t["kill_fired"] and rrc == 0 and t["identical"])
        trials.append(t)
        rounds = ",".join(map(str, t["rounds_left"])) or "-"
        log(f"{i:>3} {p['keep']:>4} {p['round']:>5} {p['node']:>4} {p['point']:<16} {frc:>8} {rrc:>9} "
            f"{'?' if t['resumed_after'] is None else t['resumed_after']:>5} "
            f"{'yes' if t['identical'] else 'NO':>9} {len(t['leftovers']):>9} {rounds:<12} {secs:>6.1f}")
        if not t["ok"]:
            why = ("the fault run did not fail" if frc == 0
                   else f"SIGKILL seen on rank(s) {fired}, not {t['rank']}" if not t["kill_fired"]
                   else f"resume exited {rrc}" if rrc != 0 else "; ".join(diff))
            log(f"#   run {i} FAILED ({fault}, keep_checkpoints={p['keep']}): {why}; logs in {folder}")
            if rrc != 0:
                log("#   resume.log ends:\n"
                    + "".join(f"#   {line}" for line in _tail(rlog).splitlines(True)))
    n = len(trials)
    summary = {"runs": n, "bit_identical": sum(t["identical"] for t in trials),
               "ok": sum(t["ok"] for t in trials), "kill_fired": sum(t["kill_fired"] for t in trials),
               "resumed": sum(t["resume_rc"] == 0 for t in trials),
               "without_leftovers": sum(not t["leftovers"] for t in trials),
               "rounds_as_reference": sum(t["rounds_as_reference"] for t in trials),
               "wall_s": round(time.perf_counter() - t_all, 1)}
    log(f"{summary['bit_identical']}/{n} bit-identical; kill fired {summary['kill_fired']}/{n}, "
        f"resume exit 0 {summary['resumed']}/{n}, no .tmp/.staged left {summary['without_leftovers']}/{n}, "
        f"checkpoint rounds left as the reference's {summary['rounds_as_reference']}/{n}; "
        f"wall {summary['wall_s']:.1f} s")
    settings = {"runs": runs, "seed": seed, "k_outer": k_outer, "n_agents": N_AGENTS, "nproc": nproc,
                "keeps": list(KEEPS),
                "timeout_s": timeout_s, "args": train_args({"backbone": "BACKBONE", "fit": "FIT"}, "DIR",
                                                           keep=0, k_outer=k_outer)}
    return {"settings": settings, "references": {str(k): v for k, v in references.items()},
            "trials": trials, "summary": summary}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kill_resume", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20,
                    help="trials, keep_checkpoints 1 and 3 alternately (default 20)")
    ap.add_argument("--out", metavar="DIR", default="runs/kill_resume",
                    help="scratch folder: assets, references, one folder per trial "
                         "(default runs/kill_resume)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the drawn round, node and point (default 0)")
    ap.add_argument("--k-outer", type=int, default=DEFAULT_K_OUTER,
                    help=f"rounds per run (default {DEFAULT_K_OUTER})")
    ap.add_argument("--nproc", type=int, default=N_AGENTS,
                    help=f"ranks for the {N_AGENTS} nodes (default {N_AGENTS}: one node per rank; fewer: "
                         "several nodes per rank)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help=f"seconds one torchrun launch may take (default {DEFAULT_TIMEOUT_S:.0f})")
    ap.add_argument("--json", metavar="PATH",
                    help="write the trials and the summary here (a JSON dict), atomically")
    a = ap.parse_args(argv)
    if a.runs < 1 or a.k_outer < 1:
        ap.error("--runs and --k-outer must be at least 1")
    if not 1 <= a.nproc <= N_AGENTS:
        ap.error(f"--nproc {a.nproc}: use 1 to {N_AGENTS} ranks (a node cannot be split over ranks)")
    from admm_dist.bench.common import hush_future_warnings, write_json

    hush_future_warnings()

    try:
        r = run(a.out, a.runs, seed=a.seed, k_outer=a.k_outer, timeout_s=a.timeout, nproc=a.nproc)
    except RuntimeError as e:
        print(f"kill_resume: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        write_json(a.json, r)
    return 0 if r["summary"]["ok"] == r["summary"]["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
