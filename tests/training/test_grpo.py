"""fit_mode grpo: group advantages per seat, the clipped surrogate as the node objective, the
sampling policy's log-probs taken under the state each seat sampled with, on-policy by
construction (refused otherwise), and the same bits on any number of ranks and after a resume."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from admm_dist.bench.launcher import launch_cpu
from admm_dist.core.errors import UserError
from admm_dist.data import derive as dv
from admm_dist.data.fitset import Example, FitSet, FitSetError
from admm_dist.model import batches as bt
from admm_dist.model import objectives as obj
from admm_dist.training.checkpoint import CheckpointError
from admm_dist.training.trainer import Trainer

from conftest import REPO, train_local
from trainer_runs import _train_worker, standin_cfg

ON_POLICY = {"sampling_structure": "on_policy"}


def _cfg(tmp, **kw):
    """The stand-in's on-policy run by GRPO: 4 queries a collection, one every round, 3 rounds."""
    return standin_cfg(tmp, **dict(dict(anchors=4, fit_mode="grpo", recollect_every=1, gen_chunk=2, k_outer=3,
                                        kl_beta=0.05), **kw))


def _last(tmp):
    return load_file(str(tmp / "run-last.safetensors"))["b"]


class _Recorder(Trainer):
    """The trainer, recording the states its nodes' sampling log-probs were taken under, by collection."""
    def collect(self, collection, states):
        self.now = collection
        return super().collect(collection, states)

    def reference(self, enc, vec, sampling=False):
        if sampling:
            self.sampled = getattr(self, "sampled", []) + [(self.now, None if vec is None else vec.clone())]
        return super().reference(enc, vec, sampling)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The uninterrupted run in one process: its folder, report and recording trainer."""
    from admm_dist.engine.dist import distributed

    tmp = tmp_path_factory.mktemp("clean")
    with distributed("cpu", timeout_s=120) as ctx:
        t = _Recorder(_cfg(tmp), ctx)
        rep = t.train()
    return tmp, rep, t


def _example(seat, anchor, reward, target="t"):
    return Example(seat=seat, role=f"r{seat}", anchor=anchor, prompt="p", target=target, reward=reward,
                   success=reward > 0)


def test_advantages_are_normalised_in_each_seats_group_and_flat_groups_are_counted():
    ex = [_example(0, "q1", r) for r in (1.0, 0.0, 0.0, 1.0)] + [_example(1, "q1", r) for r in (1.0, 1.0, 0.0, 1.0)] \
        + [_example(0, "q2", 1.0) for _ in range(4)] + [_example(1, "q2", 0.0, target="u")]
    kept, groups = dv.grpo_examples(FitSet(ex, "sft", ON_POLICY))
    assert groups == {"groups": 4, "zero_spread": 2}     # (0, q2): all right; (1, q2): one message
    assert [(e.seat, e.anchor) for e in kept] == [(0, "q1")] * 4 + [(1, "q1")] * 4   # in file order
    for seat in (0, 1):   # TRL's rule: (r - mean) / (std + 1e-4), std with Bessel's correction
        r = torch.tensor([e.reward for e in kept if e.seat == seat], dtype=torch.float64)
        want = (r - r.mean()) / (r.std() + 1e-4)
        got = torch.tensor([e.advantage for e in kept if e.seat == seat], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (seat, got, want)
    assert all(e.advantage == 0.0 for e in ex)                 # new objects: the fit set is not changed
    with pytest.raises(FitSetError, match="collect on-policy"):
        dv.derive(FitSet(ex, "sft", {"sampling_structure": "actual_trajectory"}), "grpo")
    with pytest.raises(FitSetError, match="collect with fit_mode sft"):
        dv.derive(FitSet([], "dpo", ON_POLICY), "grpo")


@pytest.mark.parametrize("kw,fix", [(dict(recollect_every=0), "set recollect_every=1"),
                                    (dict(recollect_every=2), "set recollect_every=1"),
                                    (dict(group=1), "set group >= 2"),
                                    (dict(clip_eps=0.0), "clip_eps=0.0: use a number in \\(0, 1\\)"),
                                    (dict(clip_eps_high=-0.1), "clip_eps_high=-0.1: use a number > 0")])
def test_a_wrong_grpo_setting_is_refused_in_one_line_naming_the_fix(tmp_path, kw, fix):
    with pytest.raises(UserError, match=fix) as e:
        _cfg(tmp_path, **kw)
    assert "\n" not in str(e.value)


def test_the_grpo_objective_is_the_clipped_surrogate_and_micro_batches_add_up():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(REPO / "assets" / "tiny" / "backbone"))
    g = torch.Generator().manual_seed(0)
    enc = []
    for i in range(6):
        n = 3 + i % 3
        enc.append(bt.Encoded(example_index=i, role="r", prompt_ids=[5 + i, 7], target_ids=list(range(10, 10 + n)),
                              target_mask=[1] * n, advantage=float(i % 3) - 1.0,
                              ref_logps=-torch.rand(n, generator=g), sample_logps=-torch.rand(n, generator=g)))
    cfg = obj.ObjectiveConfig(fit_mode="grpo", kl_beta=0.04, clip_eps=0.2, clip_eps_high=0.28)
    whole = bt.collate(enc, 0)
    assert torch.equal(whole.advantages, torch.tensor([-1.0, 0.0, 1.0, -1.0, 0.0, 1.0]))
    loss, metrics = obj.loss(model, whole, cfg)
    lp = obj.token_logps(model, whole)
    want, _ = obj.clipped_surrogate(lp, whole.sample_logps, whole.advantages, whole.target_mask,
                                    clip_low=0.2, clip_high=0.28, ref=whole.ref_logps, kl_beta=0.04)
    assert loss.item() == want.item() and {"clip_frac", "kl", "loss"} <= set(metrics)
    parts = [bt.collate(enc[:2], 0), bt.collate(enc[2:], 0)]   # micro-batches: divided by the whole's tokens
    summed = sum(obj.loss(model, p, cfg, obj.normalizers(parts))[0] for p in parts)
    assert torch.allclose(summed, loss, rtol=1e-6)
    enc[0].sample_logps = None                                  # a record without the sampling policy's
    with pytest.raises(UserError, match="sampling=True"):
        obj.loss(model, bt.collate(enc, 0), cfg)


def test_the_sampling_policy_is_the_state_each_collection_ran_under(clean):
    """Collection 0 samples under the backbone (no init_state), collection c under round c's z:
    each node's sampling log-probs are taken under exactly that state."""
    tmp, rep, t = clean
    assert sorted({c for c, _ in t.sampled}) == [0, 1, 2]     # one per node with examples, per collection
    assert all(v is None for c, v in t.sampled if c == 0)
    for c in (1, 2):
        z = load_file(os.path.join(str(tmp / "run.ckpt"), f"round-{c:06d}", "node-0.safetensors"))["z"]
        assert all(torch.equal(v, z) for k, v in t.sampled if k == c), c


@pytest.mark.parametrize("world", [4, pytest.param(2, marks=pytest.mark.slow)])   # 2: two nodes per rank
def test_ranks_end_with_the_one_process_runs_bits(clean, tmp_path, world):
    tmp, rep, _ = clean
    launch_cpu(_train_worker, world, _cfg(tmp_path), timeout_s=300)
    assert torch.equal(_last(tmp_path), _last(tmp))
    with open(tmp_path / "rep" / "run-train.json") as fh:   # the same groups, so the same advantages
        assert [c["reward_groups"] for c in json.load(fh)["collections"]] == \
            [c["reward_groups"] for c in rep["collections"]]


@pytest.mark.slow   # 8 ranks on 2 cores
def test_two_ranks_per_seat_in_micro_batches_end_with_the_one_process_runs_bits(tmp_path):
    kw = dict(micro_batches=2, k_outer=2)
    train_local(_cfg(tmp_path / "one", **kw))
    launch_cpu(_train_worker, 8, _cfg(tmp_path / "eight", **kw), timeout_s=600)
    assert torch.equal(_last(tmp_path / "eight"), _last(tmp_path / "one"))


def test_a_preempted_grpo_run_resumes_bit_for_bit_and_checks_its_sampling_log_probs(clean, tmp_path):
    """Preempted after round 2, one round past collection 2: the resume makes collection 2 again
    under the states the checkpoint kept and finds the sampling log-probs the run trained on
    (their digest is in the checkpoint); a checkpoint whose digest differs is refused in one line."""
    from admm_dist.engine.dist import distributed
    from admm_dist.engine.preemption import Preempted, PreemptionFlag
    from admm_dist.training import checkpoint as ckpt

    class PreemptedInRoundTwo(Trainer):
        def on_round(self, rec):
            super().on_round(rec)
            self.preempt.noted = rec.round == 2

    with distributed("cpu", timeout_s=120) as ctx, pytest.raises(Preempted):
        PreemptedInRoundTwo(_cfg(tmp_path / "cut"), ctx, preempt=PreemptionFlag()).train()
    root = ckpt.ckpt_root(str(tmp_path / "cut" / "run"))
    two = ckpt.round_dir(root, 2)
    import shutil
    shutil.copytree(tmp_path / "cut", tmp_path / "bad", ignore=shutil.ignore_patterns("rep"))
    bad_root = ckpt.ckpt_root(str(tmp_path / "bad" / "run"))
    for name in sorted(os.listdir(two)):       # the bad copy: node 1's digest is not its log-probs'
        if name == "node-1.json":
            with open(os.path.join(two, name)) as fh:
                meta = json.load(fh)
            assert meta["sampling"] is not None
            tensors = load_file(os.path.join(two, "node-1.safetensors"))
            meta = {k: v for k, v in meta.items() if k not in ("round", "node", "tensors_sha256", "meta_sha256")}
            meta["sampling"] = "0" * 16
            ckpt.save_node(bad_root, 2, 1, tensors, meta)
    with pytest.raises(CheckpointError, match=r"node-1: collection 2, made again .* resume=never starts over$"):
        train_local(_cfg(tmp_path / "bad", resume="auto"))
    resumed = train_local(_cfg(tmp_path / "cut", resume="auto"))
    assert resumed["resumed"]["after_round"] == 2
    assert torch.equal(_last(tmp_path / "cut"), _last(clean[0]))
