"""The trainer with on-policy collection on the stand-in: collection, re-collection on fresh
queries, the fit-set cache and its settings key, and 4 gloo ranks against one process."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from admm_dist.core.errors import UserError
from admm_dist.data.fitset import load_fitset, save_fitset
from admm_dist.bench.launcher import launch_cpu
import faults
from admm_dist.demo import standin
from admm_dist.training.trainer import Trainer

from conftest import cli_rank, train_local
from trainer_runs import _train_worker, standin_cfg


# Rollouts in chunks of 2 queries: on several ranks each rank rolls out its own chunks (chunk c on
# rank c mod W). The fit set does not depend on the chunks (gen_chunk is no part of its key), so a
# run in one process takes its queries in one chunk (a third less time than chunks of 2).
CHUNKS = dict(gen_chunk=2)


_cfg = standin_cfg


def test_recollection_takes_fresh_queries_and_the_cache_is_keyed(tmp_path):
    cache = tmp_path / "fit.jsonl"
    rep = train_local(_cfg(tmp_path, recollect_every=1, fitset_cache=str(cache)))
    cols = rep["collections"]
    assert [c["collection"] for c in cols] == [0, 1] and rep["fitset_provenance"] == "collected"
    assert len(rep["anchor_keys"]) == 12   # two disjoint slices of 6 queries: all listed for evaluation
    f = load_fitset(str(cache))
    assert f.settings["sampling_structure"] == "on_policy" and f.fit_mode == "sft"
    assert set(f.anchor_keys) < set(rep["anchor_keys"])
    # the second run reads the cache instead of collecting
    rep2 = train_local(_cfg(tmp_path / "again", fitset_cache=str(cache)))
    assert rep2["fitset_provenance"] == "file" and "collections" not in rep2
    # a cache built under other collection settings is refused, naming the key
    with pytest.raises(UserError, match="group"):
        train_local(_cfg(tmp_path / "other", fitset_cache=str(cache), group=5))
    # a cache collected before targets kept their end-of-turn token (no `targets` entry) is refused
    old = tmp_path / "old.jsonl"
    save_fitset(str(old), f.examples, fit_mode=f.fit_mode, stats=f.stats, anchor_keys=f.anchor_keys,
                settings={k: v for k, v in f.settings.items() if k != "targets"})
    with pytest.raises(UserError, match="targets.*collect again"):
        train_local(_cfg(tmp_path / "old", fitset_cache=str(old)))
    # smaller re-collections: the first collection is the cached one, the second takes 3 fresh queries
    rep3 = train_local(_cfg(tmp_path / "fewer", recollect_every=1, recollect_anchors=3, fitset_cache=str(cache)))
    assert [c["queries"] for c in rep3["collections"]] == [3]
    assert len(rep3["anchor_keys"]) == 9 and set(rep3["anchor_keys"]) >= set(f.anchor_keys)


@pytest.mark.parametrize("world", [4, pytest.param(2, marks=pytest.mark.slow)])  # 2: two nodes per rank
def test_gloo_ranks_collect_and_train_like_one_process(tmp_path, world):
    local = _cfg(tmp_path / "local")            # one chunk: the ranks' chunks give its fit set
    dist = _cfg(tmp_path / "dist", **CHUNKS)
    launch_cpu(_train_worker, world, dist, timeout_s=300)
    rep = train_local(local)
    zd = load_file(str(tmp_path / "dist" / "run-last.safetensors"))
    zl = load_file(str(tmp_path / "local" / "run-last.safetensors"))
    (kd,), (kl,) = zd.keys(), zl.keys()
    assert torch.allclose(zd[kd], zl[kl], rtol=1e-5, atol=1e-7)
    with open(tmp_path / "dist" / "rep" / "run-train.json") as fh:
        drep = json.load(fh)
    assert drep["collections"][0]["mixed_group_rate"] == rep["collections"][0]["mixed_group_rate"]
    assert drep["node_sizes"] == rep["node_sizes"]
    assert os.path.isfile(tmp_path / "dist" / "run" / "seat_map.json")


class _Recorder(Trainer):
    """The trainer, recording the seat states each collection ran under."""
    def collect(self, collection, states):
        self.seen = getattr(self, "seen", {})
        self.seen[collection] = {s: v.clone() for s, v in states.items()}
        return super().collect(collection, states)


def _recorded_worker(ctx, cfg):
    t = _Recorder(cfg, ctx)
    t.train()
    return {c: {s: v.tolist() for s, v in st.items()} for c, st in t.seen.items()}


@pytest.mark.parametrize("arm", [dict(local_only=True),
                                 pytest.param(dict(consensus="gossip", topology="ring"), marks=pytest.mark.slow)])
def test_each_seat_recollects_under_the_state_it_deploys(tmp_path, arm):
    """Where the seats deploy their own states (local_only: x_i, inexact consensus: z_i), the
    re-collection runs each seat under its own (not node 0's on every seat), the same on 2 gloo
    ranks as in one process."""
    from admm_dist.engine.dist import distributed

    cfg = _cfg(tmp_path / "one", k_outer=2, recollect_every=1, **arm)
    with distributed("cpu", timeout_s=120) as ctx:
        t = _Recorder(cfg, ctx)
        t.train()
    states = t.seen[1]
    key = "x" if arm.get("local_only") else "z"
    # round 1's checkpoint holds the states collection 1 ran under (node i is adapted seat i)
    ck = os.path.join(cfg.out + ".ckpt", "round-000001")
    for i, s in enumerate(cfg.adapted_seats()):
        assert torch.equal(states[s], load_file(os.path.join(ck, f"node-{i}.safetensors"))[key]), (s, key)
    moved = [s for s in cfg.adapted_seats() if states[s].abs().sum() > 0]
    assert len({tuple(states[s].tolist()) for s in moved}) == len(moved) >= 2   # seats differ
    two = launch_cpu(_recorded_worker, 2, _cfg(tmp_path / "two", k_outer=2, recollect_every=1, **CHUNKS,
                                               **arm), timeout_s=300)
    for r in (0, 1):
        assert {s: torch.tensor(v) for s, v in two[r][1].items()}.keys() == states.keys()
        assert all(torch.equal(torch.tensor(two[r][1][s]), states[s]) for s in states)


def test_kl_ref_collect_follows_the_policy_of_each_collection(tmp_path):
    """kl_ref collect: the first collection's examples take the backbone as reference (no
    init_state), a re-collection's take the state that collected them (here round 1's z)."""
    from admm_dist.engine.dist import distributed

    class Refs(Trainer):
        def reference(self, enc, vec):
            self.refs = getattr(self, "refs", []) + [None if vec is None else vec.clone()]
            return super().reference(enc, vec)

    cfg = _cfg(tmp_path, k_outer=2, recollect_every=1, kl_ref="collect")
    with distributed("cpu", timeout_s=120) as ctx:
        t = Refs(cfg, ctx)
        t.train()
    z1 = load_file(os.path.join(cfg.out + ".ckpt", "round-000001", "node-0.safetensors"))["z"]
    n = len(t.refs) // 2                           # one per node with examples, per collection
    assert n >= 2 and all(v is None for v in t.refs[:n])
    assert all(torch.equal(v, z1) for v in t.refs[n:])


def test_a_run_preempted_between_collections_resumes_bit_for_bit(tmp_path):
    """Re-collection every 2 rounds, preempted after round 5 (one round past collection 2) and
    resumed: the resume collects again under the states collection 2 ran under (round 4's,
    kept in the checkpoint), not round 5's, so its fit set, its KL references (kl_ref collect)
    and every result are the uninterrupted run's, and its report lists every collection
    (collection 1's too, made only by the first attempt) and every query trained on. With
    dev_frac the held-out examples are the first collection's for the whole run (every round's
    held-out NLL, which -best compares, is measured on one set)."""
    from admm_dist.engine.dist import distributed
    from admm_dist.engine.preemption import Preempted, PreemptionFlag

    kw = dict(k_outer=6, recollect_every=2, kl_ref="collect", dev_frac=0.25, anchors=4, group=3)
    clean = train_local(_cfg(tmp_path / "clean", fitset_cache=str(tmp_path / "clean.jsonl"), **kw))
    assert clean["dev_held_out"] > 0 and [p["round"] for p in clean["dev_curve"]] == [1, 2, 3, 4, 5, 6]

    class PreemptedInRoundFive(Trainer):     # SIGUSR2 during round 5: it stops after round 5
        def on_round(self, rec):
            super().on_round(rec)
            self.preempt.noted = rec.round == 5

    with distributed("cpu", timeout_s=120) as ctx, pytest.raises(Preempted):
        PreemptedInRoundFive(_cfg(tmp_path / "cut", fitset_cache=str(tmp_path / "cut.jsonl"), **kw), ctx,
                             preempt=PreemptionFlag()).train()
    _refuses_a_checkpoint_without_the_states(tmp_path, kw)
    # the first attempt wrote its first collection to cut.jsonl: the resume reads it from there
    resumed = train_local(_cfg(tmp_path / "cut", fitset_cache=str(tmp_path / "cut.jsonl"), resume="auto", **kw))
    assert resumed["resumed"]["after_round"] == 5

    def figures(report):      # each collection's record but its timing
        return [{k: v for k, v in c.items() if "sec" not in k} for c in report["collections"]]

    assert [c["collection"] for c in resumed["collections"]] == [0, 1, 2]
    assert figures(resumed) == figures(clean)
    assert resumed["anchor_keys"] == clean["anchor_keys"] and len(set(clean["anchor_keys"])) == 4 * 3
    assert resumed["dev_curve"] == clean["dev_curve"] and resumed["best"] == clean["best"]
    assert resumed["dev_held_out"] == clean["dev_held_out"]
    for suffix in ("-best.safetensors", "-last.safetensors"):
        a = load_file(str(tmp_path / "clean" / "run") + suffix)
        b = load_file(str(tmp_path / "cut" / "run") + suffix)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), suffix


def _refuses_a_checkpoint_without_the_states(tmp_path, kw):
    """A copy of the preempted run whose round-5 files lack ``collected_under`` (damaged, or of
    another version) cannot collect again as the run did: one line; deleting that round, as it
    says, resumes from the one before."""
    import shutil

    from admm_dist.training import checkpoint as ckpt
    from admm_dist.training.checkpoint import CheckpointError
    from admm_dist.training.resume import COLLECTED_UNDER

    shutil.copytree(tmp_path / "cut", tmp_path / "old", ignore=shutil.ignore_patterns("rep"))   # the run's files, not its report
    shutil.copy(tmp_path / "cut.jsonl", tmp_path / "old.jsonl")
    root = ckpt.ckpt_root(str(tmp_path / "old" / "run"))
    five = ckpt.round_dir(root, 5)
    for name in sorted(os.listdir(five)):
        if name.endswith(".json"):
            node = int(name[len("node-"):-len(".json")])
            with open(os.path.join(five, name)) as fh:
                meta = json.load(fh)
            tensors = load_file(os.path.join(five, f"node-{node}.safetensors"))
            assert tensors.pop(COLLECTED_UNDER) is not None
            meta = {k: v for k, v in meta.items() if k not in ("round", "node", "tensors_sha256", "meta_sha256")}
            ckpt.save_node(root, 5, node, tensors, meta)
    cfg = _cfg(tmp_path / "old", fitset_cache=str(tmp_path / "old.jsonl"), resume="auto", **kw)
    with pytest.raises(CheckpointError, match=r"lacks the states of collection 2: .*delete that round folder"):
        train_local(cfg)
    shutil.rmtree(five)
    assert train_local(cfg)["resumed"]["after_round"] == 4


def test_collection_errors_are_one_line(tmp_path):
    with pytest.raises(UserError, match="sink_tokens > 0"):
        train_local(_cfg(tmp_path, sink_tokens=0))
    with pytest.raises(UserError, match="judge_fitset"):
        train_local(_cfg(tmp_path, reward="judge"))
    with pytest.raises(ValueError, match="anchor_pass_band"):
        _cfg(tmp_path, anchor_pass_band="0.5")


def _launch_cli(tmp, nproc, monkeypatch, restarts=0, fault=None, **kw):
    """``torchrun --nproc_per_node NPROC -m admm_dist.train`` with the settings of :func:`_cfg`:
    torchrun's agent from the launcher (no interpreter start-up per rank)."""
    cfg = _cfg(tmp, **dict(CHUNKS, **kw)).as_dict()
    args = [f"{k}={v}" for k, v in cfg.items() if v is not None and k not in ("quiet",)]
    monkeypatch.delenv(faults.ENV, raising=False)
    if fault:
        monkeypatch.setenv(faults.ENV, fault)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return launch_cpu(cli_rank, nproc, args, timeout_s=300, max_restarts=restarts, setup=False)


@pytest.mark.slow   # collection on 4 ranks; a killed rank's resume: the default suite's test_outputs_mp.py
def test_killed_rank_resumes_and_recollects_bit_for_bit(tmp_path, monkeypatch, capfd):
    """A rank dies after round 3, one round past collection 1; the restart collects round 2's
    fresh queries again under round 2's z (kept in round 3's checkpoint: the same z gives the
    same rollouts) and ends with the same z."""
    kw = dict(k_outer=4, recollect_every=2, anchors=4, group=3)
    assert _launch_cli(tmp_path / "clean", 4, monkeypatch, **kw) == {r: 0 for r in range(4)}
    capfd.readouterr()
    hurt = _launch_cli(tmp_path / "hurt", 4, monkeypatch, restarts=1, fault="3:1", resume="auto", **kw)
    assert hurt == {r: 1 for r in range(4)}                      # it did die and every rank restarted
    text = "".join(capfd.readouterr())
    assert "continuing after round 3" in text
    assert text.count("collection 1:") == 2    # before the kill and after
    a = load_file(str(tmp_path / "clean" / "run-last.safetensors"))
    b = load_file(str(tmp_path / "hurt" / "run-last.safetensors"))
    assert torch.equal(a["b"], b["b"])


def test_agent_models_puts_another_backbone_in_one_seat(tmp_path):
    """A compromised seat: seat 1 runs on the random tiny backbone during collection."""
    tiny = os.path.join(os.path.dirname(str(standin.DEFAULT_DIR)), "tiny", "backbone")
    kw = dict(anchors=4, group=2, k_outer=1, credit="shared", fit_mode="sft")
    train_local(_cfg(tmp_path / "a", fitset_cache=str(tmp_path / "a.jsonl"), **kw))
    train_local(_cfg(tmp_path / "b", fitset_cache=str(tmp_path / "b.jsonl"), agent_models=f"1={tiny}", **kw))
    a, b = load_fitset(str(tmp_path / "a.jsonl")), load_fitset(str(tmp_path / "b.jsonl"))
    seat = lambda f, k: [e.target for e in f.examples if e.seat == k]  # noqa: E731
    assert seat(a, 0) == seat(b, 0)          # upstream of the swapped seat: unchanged
    assert seat(a, 1) != seat(b, 1)          # the swapped seat speaks for the other backbone
    assert b.settings["agent_models"] == f"1={tiny}"


@pytest.mark.slow
def test_two_ranks_per_seat_collect_their_own_chunks_and_train_like_one_process(tmp_path):
    """4 seats on 8 ranks (k = 2): every rank rolls out its own chunks of the queries, the fit
    sets are the one process's, and training with micro_batches 2 ends where it does."""
    kw = dict(micro_batches=2, recollect_every=1, **CHUNKS)
    local, dist = _cfg(tmp_path / "local", **kw), _cfg(tmp_path / "dist", **kw)
    launch_cpu(_train_worker, 8, dist, timeout_s=600)
    rep = train_local(local)
    with open(tmp_path / "dist" / "rep" / "run-train.json") as fh:
        drep = json.load(fh)
    assert drep["placement"] == [[s] for s in range(4) for _ in range(2)]
    assert drep["anchor_keys"] == rep["anchor_keys"] and drep["node_sizes"] == rep["node_sizes"]
    assert [c["mixed_group_rate"] for c in drep["collections"]] == [c["mixed_group_rate"] for c in rep["collections"]]
    assert torch.equal(load_file(str(tmp_path / "dist" / "run-last.safetensors"))["b"],
                       load_file(str(tmp_path / "local" / "run-last.safetensors"))["b"])
