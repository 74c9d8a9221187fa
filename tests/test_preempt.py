"""SIGUSR2 (SLURM's warning before the time limit): every rank checkpoints the same round and
exits 0; ``resume=auto`` then finishes with the same z as a run that was never stopped."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from admm_dist.synthetic import write_fitset
from admm_dist.tiny import save_tiny_backbone

N = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("assets")
    bb = save_tiny_backbone(str(d / "backbone"), seed=1, hidden=32, layers=2, heads=2)
    settings = {"task": "synthetic", "n_agents": N, "adapt_roles": "all"}
    fit = write_fitset(str(d / "dpo.jsonl"), settings=settings, per_seat=16,
                       tokenizer=AutoTokenizer.from_pretrained(bb))
    return {"backbone": bb, "fit": fit}


def _args(assets, out, **kw):
    d = dict(model_name=assets["backbone"], fitset_cache=assets["fit"], task="synthetic", n_agents=N,
             device="cpu", lora_rank=4, lora_alpha=8.0, lora_layers_last=2, k_outer=40, local_steps=2,
             batch_size=4, eta=0.02, rho=0.1, grad_clip=1.0, checkpoint_every=100, timeout_s=60,
             out=str(out / "run"), report_dir=str(out / "rep"))
    d.update(kw)
    return [f"{k}={v}" for k, v in d.items()]


def _cmd(args, nproc):
    if nproc == 1:
        return [sys.executable, "-m", "admm_dist.train"] + args
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "admm_dist.train"] + args


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(p) for p in fh.read().split()]


def _preempt(args, nproc, deadline=240):
    """Start the run, send SIGUSR2 to one process once round 1 is logged, wait for the end."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.Popen(_cmd(args, nproc), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, t0 = [], time.time()
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith("round   1/"):
                target = p.pid if nproc == 1 else _children(p.pid)[-1]   # one worker only
                os.kill(target, signal.SIGUSR2)
            if time.time() - t0 > deadline:
                break
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    return rc, "".join(lines)


@pytest.mark.parametrize("nproc", [1, N])
def test_sigusr2_checkpoints_every_rank_and_resume_finishes_the_same(assets, tmp_path, nproc):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    clean = subprocess.run(_cmd(_args(assets, tmp_path / "clean"), nproc), env=env, capture_output=True,
                           text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr[-2000:]
    rc, out = _preempt(_args(assets, tmp_path / "cut"), nproc)
    assert rc == 0, out[-2000:]
    stopped = [line for line in out.splitlines() if "preempted after round" in line]
    assert len(stopped) == 1, out[-2000:]
    k = int(stopped[0].split("preempted after round ")[1].split(":")[0])
    assert 1 <= k < 40
    rounds = sorted(os.listdir(tmp_path / "cut" / "run.ckpt"))
    assert rounds[-1] == f"round-{k:06d}", rounds
    assert not os.path.exists(tmp_path / "cut" / "run-last.safetensors")
    done = subprocess.run(_cmd(_args(assets, tmp_path / "cut", resume="auto"), nproc), env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"continuing after round {k}" in done.stdout
    a = load_file(str(tmp_path / "clean" / "run-last.safetensors"))["b"]
    b = load_file(str(tmp_path / "cut" / "run-last.safetensors"))["b"]
    assert torch.equal(a, b)
