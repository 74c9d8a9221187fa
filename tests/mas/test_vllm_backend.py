"""The vLLM rollout backend against the HF backend, on the stand-in (assets/standin).

Needs vLLM (the main environment has none: the module is skipped there). On CPU, run in
the separate vLLM environment (docs/vllm.md):

    .venv-vllm/bin/python -m pytest -q -m vllm -n 0 tests/mas/test_vllm_backend.py

One engine serves the whole module (an engine takes 20-40 s to start on 2 cores).
"""
import dataclasses
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this environment (run in .venv-vllm: see docs/vllm.md)",
                allow_module_level=True)

REPO = REPO
STANDIN = str(REPO / "assets" / "standin")
ADAPTER = dict(lora_rank=4, lora_alpha=8.0, lora_layers_last=2, lora_targets="attn_mlp", lora_basis_seed=0)
SCALE = 0.05                # B = SCALE * N(0, 1): changes ~1 in 6 greedy seat-0 messages of the stand-in
# Measured (fp32, CPU, one worker thread, 278 sampled tokens, seeded draws): max |vLLM - HF|
# log-prob 1.8e-5 without the adapter and 1.8e-5 with it; mean 1.9e-7 / 2.9e-7 (the same for the
# sampled tokens' logprobs and for prompt_logprobs; other draws gave max 1.6e-5 - 2.4e-5). The
# differences are fp32 summation order: vLLM fuses qkv/gate_up, runs its own attention kernel and
# adds LoRA as shrink/expand, HF merges W + s B A. The tolerances leave ~10x (max) and ~50x
# (mean) headroom for other CPUs and thread counts; the adapter itself moves the same log-probs
# by mean 3.0e-2 (max 1.3), 3000x the mean tolerance.
LOGPROB_TOL_MAX, LOGPROB_TOL_MEAN = 2e-4, 1e-5


def state(seed: int, numel: int, scale: float = SCALE) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale


@dataclasses.dataclass
class Stack:
    model: object
    tok: object
    adapter: object
    backend: object
    runner: object
    workdir: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from admm_dist.mas import ChainRunner
    from admm_dist.mas.vllm_backend import VLLMBackend
    from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
    from admm_dist.demo.standin import chain_config, load

    model, tok = load(STANDIN)
    ad = BOnlyLoRA(model, AdapterConfig(**ADAPTER))
    wd = tmp_path_factory.mktemp("vllm")
    t0 = time.monotonic()
    be = VLLMBackend(STANDIN, tok, ad, workdir=str(wd / "lora"), seed=0, max_model_len=512,
                     dtype="float32", kv_cache_gib=0.25)
    print(f"\n[vllm] engine start {time.monotonic() - t0:.1f}s (dtype {be.dtype}, max_lora_rank "
          f"{be.max_lora_rank}, stop ids {be.stop_ids})")
    runner = ChainRunner(ad.model, tok, chain_config(4), adapter=ad)
    try:
        yield Stack(model, tok, ad, be, runner, wd)
    finally:
        be.close()


def seat_prompts(s: Stack, n_items: int, seed: int = 0):
    """Every seat's prompt on greedy HF chains of ``n_items`` held-out questions (4 x n prompts)."""
    from admm_dist.tasks.chain_arith import load_chain_arith

    items = load_chain_arith("eval", n=n_items, seed=seed, n_ops=3)
    chains = [rs[0] for rs in s.runner.run(items, greedy=True)]
    return [s.runner.prompt_text(seat, it, ch.texts) for seat in range(4) for it, ch in zip(items, chains)]


@torch.no_grad()
def hf_logprobs(model, tok, prompts, completions):
    """Teacher-forced log p of each completion token under the HF model."""
    out = []
    for p, c in zip(prompts, completions):
        ids = tok(p, add_special_tokens=False)["input_ids"]
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids + list(c)])).logits[0].float(), -1)
        out.append([lp[len(ids) - 1 + j, t].item() for j, t in enumerate(c)])
    return out


def hf_under(s: Stack, vec):
    """A context giving the HF model with the adapter off (vec None) or holding ``vec``."""
    import contextlib

    if vec is None:
        return s.adapter.disabled()
    s.adapter.load_vector(vec)
    return contextlib.nullcontext(s.adapter.model)


def diffs(a, b):
    assert [len(x) for x in a] == [len(y) for y in b]
    return [abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]


# ----------------------------------------------------------------------------- a
@pytest.mark.parametrize("with_state", [False, True], ids=["base", "seat-state"])
def test_sampled_logprobs_match_the_hf_model(stack, with_state):
    s = stack
    vec = state(1, s.adapter.numel) if with_state else None
    prompts = seat_prompts(s, 8)
    gens = s.backend.generate(prompts, seeds=list(range(len(prompts))), max_new_tokens=16, temperature=0.8,
                              top_p=0.95, state=vec, return_logprobs=True)
    toks = s.backend.last_token_ids
    assert all(g.n_tokens == len(t) for g, t in zip(gens, toks))
    with hf_under(s, vec) as m:
        ref = hf_logprobs(m, s.tok, prompts, toks)
    sampled = diffs(s.backend.last_logprobs, ref)
    forced = diffs(s.backend.logprobs_of(prompts, toks, state=vec), ref)
    print(f"\n[vllm] {'seat state' if with_state else 'base'}: {len(sampled)} tokens; sampled-token "
          f"log-prob |vLLM - HF| max {max(sampled):.2e} mean {sum(sampled) / len(sampled):.2e}; "
          f"prompt_logprobs max {max(forced):.2e} mean {sum(forced) / len(forced):.2e}")
    for d in (sampled, forced):
        assert max(d) < LOGPROB_TOL_MAX and sum(d) / len(d) < LOGPROB_TOL_MEAN
    if with_state:   # the adapter moves these log-probs far more than the tolerance
        with hf_under(s, None) as m:
            off = diffs(hf_logprobs(m, s.tok, prompts, toks), ref)
        print(f"[vllm] the adapter moves them by max {max(off):.2e} mean {sum(off) / len(off):.2e}")
        assert sum(off) / len(off) > 100 * LOGPROB_TOL_MEAN


# ----------------------------------------------------------------------------- b
def vllm_chains(s: Stack, items, samples: int, seed: int, seat_states):
    """Final messages of chains rolled out with ChainRunner on the vLLM backend."""
    from admm_dist.mas import ChainRunner

    runner = ChainRunner(s.adapter.model, s.tok, s.runner.cfg, adapter=s.adapter, seat_states=seat_states,
                         generator=s.backend)
    return [[r.final_text for r in rs] for rs in runner.run(items, samples=samples, seed=seed)]


def rate_ci(per_query):
    """Pass rate over queries and its 95% half-width, with the query as the cluster: the
    samples of one query are correlated, so the unit of the variance is the per-query rate."""
    n = len(per_query)
    p = sum(per_query) / n
    var = sum((y - p) ** 2 for y in per_query) / (n - 1)
    return p, 1.96 * math.sqrt(var / n)


@pytest.mark.timeout(900)   # generous: in CI it runs niced beside the slow suite
def test_chain_pass_rate_matches_the_hf_backend(stack):
    from admm_dist import tasks
    from admm_dist.mas import ChainRunner
    from admm_dist.tasks.chain_arith import load_chain_arith

    s, n, k = stack, 64, 4
    items = load_chain_arith("eval", n=n, seed=3, n_ops=3)
    seat_states = {1: state(31, s.adapter.numel)}        # seat 1 runs a state, the others the base model
    t0 = time.monotonic()
    hf_runner = ChainRunner(s.adapter.model, s.tok, s.runner.cfg, adapter=s.adapter, seat_states=seat_states)
    hf = [[r.final_text for r in rs] for rs in hf_runner.run(items, samples=k, seed=0)]
    t_hf = time.monotonic() - t0
    t0 = time.monotonic()
    vl = vllm_chains(s, items, k, seed=0, seat_states=seat_states)
    t_vl = time.monotonic() - t0

    def per_query(finals):
        return [sum(tasks.score("chain_arith", t, it)[1] for t in fs) / k for fs, it in zip(finals, items)]

    yh, yv = per_query(hf), per_query(vl)
    (ph, hh), (pv, hv) = rate_ci(yh), rate_ci(yv)
    d, hd = rate_ci([a - b for a, b in zip(yv, yh)])   # paired by query
    print(f"\n[vllm] pass rate on {n} queries x {k} samples, 4 seats (seat 1 with a state): "
          f"HF {ph:.3f} +- {hh:.3f} ({t_hf:.1f}s), vLLM {pv:.3f} +- {hv:.3f} ({t_vl:.1f}s); "
          f"vLLM - HF {d:+.3f} +- {hd:.3f} (95%, paired by query)")
    assert 0.05 < ph < 0.98, "the stand-in should be partly right when sampled"
    # the two 95% intervals overlap (a false alarm well under 1% for two equal-variance
    # estimates; both backends' draws are fixed by the row seeds, so the outcome is repeatable)
    assert abs(pv - ph) <= hh + hv


def test_seeded_rows_are_reproducible_and_batch_invariant(stack):
    s = stack
    prompts = seat_prompts(s, 16)                    # 64 prompts, ~3.4k prompt tokens
    seeds = [1000 + i for i in range(len(prompts))]
    kw = dict(max_new_tokens=16, temperature=0.8, top_p=0.95, state=state(41, s.adapter.numel))
    first = s.backend.generate(prompts, seeds=seeds, **kw)
    assert s.backend.generate(prompts, seeds=seeds, **kw) == first
    assert s.backend.generate(prompts[::-1], seeds=seeds[::-1], **kw)[::-1] == first
    assert s.backend.generate(prompts[7:8], seeds=seeds[7:8], **kw) == first[7:8]
    other = s.backend.generate(prompts, seeds=[2000 + i for i in range(len(prompts))], **kw)
    assert other != first                            # the seed, not the engine, picks the draw
    # a batch over vLLM's token budget per step (chunked prefill would split a prompt there)
    many = prompts * 8
    assert s.backend.generate(many, seeds=seeds * 8, **kw) == first * 8


# ----------------------------------------------------------------------------- c
def test_recollection_uses_the_updated_state_on_the_same_engine(stack):
    from admm_dist.mas.generate import generate

    s = stack
    s1, s2 = state(11, s.adapter.numel), state(12, s.adapter.numel)
    prompts = seat_prompts(s, 8, seed=5)
    greedy = dict(seeds=[None] * len(prompts), max_new_tokens=16, temperature=0.8, top_p=0.95)
    llm, n_ids = s.backend.llm, s.backend._states.next_id
    hf = {}
    for name, vec in (("s1", s1), ("s2", s2)):
        with hf_under(s, vec) as m:
            hf[name] = generate(m, s.tok, prompts, **greedy)
    assert [g.text for g in hf["s1"]] != [g.text for g in hf["s2"]], "pick states whose outputs differ"

    g1 = s.backend.generate(prompts, state=s1, **greedy)
    g2 = s.backend.generate(prompts, state=s2, return_logprobs=True, **greedy)
    assert g1 == hf["s1"] and g2 == hf["s2"]          # text, finished, n_tokens row for row
    toks = s.backend.last_token_ids
    for name, vec in (("s1", s1), ("s2", s2)):
        with hf_under(s, vec) as m:
            hf[name + "_lp"] = hf_logprobs(m, s.tok, prompts, toks)
    near, far = diffs(s.backend.last_logprobs, hf["s2_lp"]), diffs(s.backend.last_logprobs, hf["s1_lp"])
    assert max(near) < LOGPROB_TOL_MAX and sum(near) / len(near) < LOGPROB_TOL_MEAN
    assert sum(far) / len(far) > 100 * LOGPROB_TOL_MEAN
    assert s.backend.llm is llm and s.backend._states.next_id == n_ids + 2    # no restart, two new adapters
    # the same state again is the cached adapter, not a new one
    assert s.backend.generate(prompts, state=s1, **greedy) == g1 and s.backend._states.next_id == n_ids + 2
    # budget cuts and base model rows keep the HF semantics too
    with s.adapter.disabled() as m:
        short = generate(m, s.tok, prompts, **dict(greedy, max_new_tokens=3))
    assert s.backend.generate(prompts, **dict(greedy, max_new_tokens=3)) == short
    assert not any(g.finished for g in short) and all(g.n_tokens == 3 for g in short)
    empty = s.backend.generate(prompts, **dict(greedy, max_new_tokens=0))
    assert empty == [type(short[0])("", False, 0)] * len(prompts)


def test_the_adapter_cache_is_bounded(stack):
    from admm_dist.mas import vllm_backend as vb

    s = stack
    prompts = seat_prompts(s, 2)
    for i in range(vb.MAX_STATES + 3):
        s.backend.generate(prompts, seeds=[None] * len(prompts), max_new_tokens=4, temperature=1.0, top_p=1.0,
                           state=state(100 + i, s.adapter.numel))
    folders = [p for p in os.listdir(s.backend.workdir) if p.startswith("lora-")]
    assert len(folders) == len(s.backend._states) == vb.MAX_STATES
    assert len(s.backend.llm.llm_engine.list_loras()) <= vb.MAX_STATES


# ----------------------------------------------------------------------------- d
def test_exported_adapter_holds_the_frozen_basis_and_the_state_exactly(stack):
    from safetensors.torch import load_file

    s = stack
    vec = state(21, s.adapter.numel)
    own = s.adapter.vector().clone()
    req = s.backend._lora_for(vec)
    assert torch.equal(s.adapter.vector(), own)          # exporting leaves the adapter's vector as it was
    cfg = json.loads(Path(req.lora_path, "adapter_config.json").read_text())
    assert cfg["r"] == ADAPTER["lora_rank"] and cfg["lora_alpha"] == ADAPTER["lora_alpha"]
    assert cfg["r"] <= s.backend.max_lora_rank
    tensors = load_file(str(Path(req.lora_path, "adapter_model.safetensors")))
    a_keys = sorted(k for k in tensors if ".lora_A." in k)
    assert len(a_keys) == len([name for name, _, _ in s.adapter.layout()])
    for name, a, (lname, shape, off) in zip([name for name, _, _ in s.adapter.layout()], s.adapter._a_weights, s.adapter.layout()):
        key = f"base_model.model.{name}.lora_A.weight"
        assert key in tensors, (key, a_keys[:3])
        assert tensors[key].dtype == torch.float32 and torch.equal(tensors[key], a.detach().cpu())
        b = tensors[f"base_model.model.{name}.lora_B.weight"]
        n = shape[0] * shape[1]
        assert torch.equal(b, vec[off:off + n].view(shape))
    assert s.adapter.basis_hash(recompute=True) == s.adapter.basis_hash()


# ----------------------------------------------------------------------------- errors
def test_clear_errors(stack, tmp_path, monkeypatch):
    from admm_dist.mas import vllm_backend as vb

    s = stack
    with pytest.raises(vb.VLLMBackendError, match="config.json missing"):
        vb.VLLMBackend(str(tmp_path), s.tok, workdir=str(tmp_path / "w"))
    with pytest.raises(vb.VLLMBackendError, match="P="):
        s.backend.generate(["x"], seeds=[None], max_new_tokens=2, temperature=1.0, top_p=1.0,
                           state=torch.zeros(3))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        s.backend.generate(["x"], seeds=[1], max_new_tokens=2, temperature=0.0, top_p=1.0)
    with pytest.raises(vb.VLLMBackendError, match="max_model_len"):
        s.backend.generate(["1" * 600], seeds=[None], max_new_tokens=2, temperature=1.0, top_p=1.0)
    assert vb.lora_rank_for(4) == 8 and vb.lora_rank_for(16) == 16 and vb.lora_rank_for(200) == 256
    closed = vb.VLLMBackend.__new__(vb.VLLMBackend)
    with pytest.raises(vb.VLLMBackendError, match="closed"):
        closed.generate(["x"], seeds=[None], max_new_tokens=2, temperature=1.0, top_p=1.0)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(vb.VLLMBackendError, match=r"generation_backend=vllm needs vLLM: .*bash launch/vllm_env.sh"):
        vb._import_vllm()


# ----------------------------------------------------------------------------- e
RANK_SCRIPT = textwrap.dedent('''
    import datetime, json, os, sys, time
    import torch
    import torch.distributed as dist

    VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LD_PRELOAD")

    def main():
        out, standin, adapter_kw, scale = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
        prompts = json.loads(open(os.path.join(out, "prompts.json")).read())
        t0 = time.monotonic()
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=240))
        rank = dist.get_rank()
        from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
        from admm_dist.mas.vllm_backend import VLLMBackend
        from admm_dist.demo.standin import load
        model, tok = load(standin)
        ad = BOnlyLoRA(model, AdapterConfig(**adapter_kw))
        vec = torch.randn(ad.numel, generator=torch.Generator().manual_seed(1)) * scale
        before = {k: os.environ.get(k) for k in VARS}
        t1 = time.monotonic()
        be = VLLMBackend(standin, tok, ad, workdir=os.path.join(out, f"wd-{rank}"), seed=0, max_model_len=512,
                         dtype="float32", kv_cache_gib=0.25)
        t_engine = time.monotonic() - t1
        after = {k: os.environ.get(k) for k in VARS}
        gens = be.generate(prompts, seeds=[None] * len(prompts), max_new_tokens=16, temperature=1.0, top_p=1.0,
                           state=vec if rank == 1 else None)
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)                      # the trainer's group still works
        be.close()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump({"texts": [g.text for g in gens], "before": before, "after": after, "sum": x.item(),
                       "threads": torch.get_num_threads(), "t_engine": t_engine,
                       "t_total": time.monotonic() - t0}, fh)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        main()
''')


RANK1_SCALE = 0.1           # rank 1 runs a stronger state, so its greedy outputs visibly differ


@pytest.mark.timeout(900)   # generous: in CI it runs niced beside the slow suite
def test_each_torchrun_rank_builds_its_own_engine(stack, tmp_path):
    s = stack
    prompts = seat_prompts(s, 4)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(tmp_path), STANDIN, json.dumps(ADAPTER), str(RANK1_SCALE)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=840)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)   # its own session: torchrun, the ranks and their engines
            proc.wait(timeout=30)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, out[-4000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    starts = ", ".join(f"{r['t_engine']:.1f}s" for r in res)
    print(f"\n[vllm] 2-rank torchrun: {wall:.1f}s wall; engine start per rank {starts}")
    greedy = dict(seeds=[None] * len(prompts), max_new_tokens=16, temperature=1.0, top_p=1.0)
    want = [[g.text for g in s.backend.generate(prompts, state=v, **greedy)]
            for v in (None, state(1, s.adapter.numel, RANK1_SCALE))]
    for r in (0, 1):
        assert res[r]["texts"] == want[r]
        assert res[r]["after"] == res[r]["before"]          # RANK, LOCAL_WORLD_SIZE, LD_PRELOAD, ... restored
        assert res[r]["before"]["LOCAL_WORLD_SIZE"] == "2" and res[r]["sum"] == 3.0 and res[r]["threads"] == 1
    assert want[0] != want[1]                               # rank 1's engine ran its seat state
    if "OpenMP thread binding info" in out:                 # vLLM's log: each rank's engine on its own core
        assert "core ids=[0]" in out and "core ids=[1]" in out, out[-4000:]


def test_a_failed_start_removes_the_backends_own_folder_and_keeps_the_callers(stack, tmp_path, monkeypatch):
    """workdir=None: the backend makes its own temporary folder and removes it when it cannot
    start; a folder the caller passes stays the caller's. (After a run, close() removes the
    folder: tests/mas/test_vllm_train.py.)"""
    import tempfile

    from admm_dist.mas.vllm_backend import VLLMBackend, VLLMBackendError

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    (tmp_path / "empty").mkdir()
    with pytest.raises(VLLMBackendError, match="config.json"):
        VLLMBackend(str(tmp_path / "empty"), stack.tok)
    assert os.listdir(tmp) == []
    mine = tmp_path / "mine"
    with pytest.raises(VLLMBackendError, match="config.json"):
        VLLMBackend(str(tmp_path / "empty"), stack.tok, workdir=str(mine))
    assert mine.is_dir() and os.listdir(tmp) == []
