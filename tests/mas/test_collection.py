"""On-policy collection on the stand-in: branching, filters, DPO pairing, and the same fit
set from 3 gloo ranks as from one process."""
import dataclasses
import json

import pytest

from admm_dist import tasks
from admm_dist.data import fitset as fs
from admm_dist.data.derive import derive
from admm_dist.bench.launcher import launch_cpu
from admm_dist.mas import ChainConfig, ChainRunner
from admm_dist.mas.collection import PRESCREEN_SALT, Collector, gather_json
from admm_dist.tasks.chain_arith import load_chain_arith
from admm_dist.demo import standin

from conftest import selected

SEATS = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def runner():
    model, tok = standin.load()
    return ChainRunner(model, tok, ChainConfig(n_agents=4, words="compact", max_new_tokens=16,
                                               batch_size=256))


def _items(n, seed=0):
    return load_chain_arith("train", n=n, seed=seed)


def test_per_role_branches_share_the_prefix_and_the_downstream_seed(runner):
    col = Collector(runner, "chain_arith", SEATS, group=6, credit="per_role", seed=3, downstream_seed=9)
    items = _items(3)
    by = col.branches(items)
    for (i, k), branch in by.items():
        assert len(branch) == 6
        prefixes = {tuple(c.texts[:k]) for c in branch}
        assert len(prefixes) == 1                          # one fixed prefix per (query, seat)
        assert len({c.prompts[k] for c in branch}) == 1     # so seat k's prompt is shared
        # downstream seats use downstream_seed: the same seat-k message gives the same ending
        ends = {}
        for c in branch:
            ends.setdefault(c.texts[k], set()).add(tuple(c.texts[k + 1:]))
        assert all(len(v) == 1 for v in ends.values())
    # the seat-k samples differ across branches somewhere (the stand-in is not deterministic)
    assert any(len({c.texts[k] for c in b}) > 1 for (i, k), b in by.items() if k < 3)
    # and a different downstream seed changes some ending
    other = Collector(runner, "chain_arith", SEATS, group=6, credit="per_role", seed=3, downstream_seed=10)
    by2 = other.branches(items)
    assert [c.texts[:k + 1] for (i, k), b in by.items() for c in b] == \
        [c.texts[:k + 1] for (i, k), b in by2.items() for c in b]
    assert [c.texts for b in by.values() for c in b] != [c.texts for b in by2.values() for c in b]


def test_pass_band_keeps_exactly_the_mixed_groups(runner):
    col = Collector(runner, "chain_arith", SEATS, group=4, credit="shared", seed=1)
    items = _items(12)
    every, st_all = col.collect(items)
    kept, st = col.collect(items, pass_band=(0.0, 1.0))
    mixed = {a for a, o in st["per_group_outcomes"].items() if 0 < sum(o) < len(o)}
    assert {e.anchor for e in kept} == mixed and 0 < len(mixed) < len(items)
    assert st["kept_queries"] == len(mixed) and st["mixed_group_rate"] == pytest.approx(len(mixed) / 12)
    assert len(every) == 12 * 4 * 4 and st_all["kept_queries"] == 12
    # shared credit: every message of a chain carries the chain's outcome
    for a, outs in st_all["per_group_outcomes"].items():
        labels = [e.success for e in every if e.anchor == a and e.seat == 0]
        assert labels == [bool(o) for o in outs]


def test_prescreen_drops_queries_answered_right_twice(runner):
    col = Collector(runner, "chain_arith", SEATS, group=2, seed=5)
    cands = _items(16, seed=2)
    kept, stats = col.prescreen(cands, keep=4)
    probes = runner.run(cands, samples=2, seed=5 + PRESCREEN_SALT)
    fails = {it["anchor"]: sum(not tasks.score("chain_arith", r.final_text, it)[1] for r in rs)
             for it, rs in zip(cands, probes)}
    survivors = [it["anchor"] for it in cands if fails[it["anchor"]] > 0]
    assert stats["survivors"] == len(survivors) and stats["all_pass_discarded"] == 16 - len(survivors)
    assert [it["anchor"] for it in kept] == survivors[:4]


def test_dpo_pairs_share_a_prompt_under_per_role_credit(runner):
    items = _items(8)
    for credit in ("per_role", "shared"):
        col = Collector(runner, "chain_arith", SEATS, group=6, credit=credit, seed=2)
        exs, _ = col.collect(items)
        f = fs.FitSet(exs, "sft", {"credit": credit})
        pairs = derive(f, "dpo")
        assert pairs, credit
        assert all(p.target != p.rejected for p in pairs)
        if credit == "per_role":
            assert all(p.rejected_prompt is None for p in pairs)
        else:   # whole chains: seat 0 shares the question's prompt, later seats usually not
            assert all(p.rejected_prompt is None for p in pairs if p.seat == 0)
            assert any(p.rejected_prompt is not None for p in pairs if p.seat > 0)


def test_gold_likelihood_rewards_are_log_probs_and_labels_beat_the_mean(runner):
    col = Collector(runner, "chain_arith", [1], group=4, credit="per_role", reward="gold_likelihood", seed=0)
    exs, _ = col.collect(_items(3))
    rewards = [e.reward for e in exs]
    assert all(r < 0 for r in rewards) and len(set(rewards)) > 1
    for a in {e.anchor for e in exs}:
        grp = [e for e in exs if e.anchor == a]
        mean = sum(e.reward for e in grp) / len(grp)
        assert all(e.success == (e.reward > mean) for e in grp)
    with pytest.raises(ValueError, match="reward outcome"):
        col.collect(_items(1), pass_band=(0, 1))


def test_judge_reward_is_not_collected_on_policy(runner):
    with pytest.raises(ValueError, match="build_fitset"):
        Collector(runner, "chain_arith", SEATS, reward="judge")


CREDITS = ["shared", "per_role"]


def _collect_on_ranks(ctx, credits):
    """Each credit's collection on this rank (the model loaded once for all of them)."""
    import torch

    from admm_dist.engine.comm import make_communicator
    torch.set_num_threads(1)
    model, tok = standin.load()
    run = ChainRunner(model, tok, ChainConfig(n_agents=4, words="compact", max_new_tokens=16, batch_size=256))
    comm = make_communicator("coordinator", n_nodes=ctx.world_size, timeout=ctx.timeout)
    out = {}
    for credit in credits:
        col = Collector(run, "chain_arith", SEATS, group=3, credit=credit, seed=4, chunk=2, rank=ctx.rank,
                        world=ctx.world_size, exchange=gather_json(comm, torch.device("cpu"), ctx.timeout))
        exs, stats = col.collect(_items(7))
        out[credit] = json.dumps([dataclasses.asdict(e) for e in exs]), json.dumps(stats, sort_keys=True)
    return out


@pytest.fixture(scope="module")
def on_three_ranks(request):
    """{rank: {credit: (fit set, stats)}}: every credit this session runs
    test_three_gloo_ranks_collect_the_same_fit_set_as_one_process with, collected on 3 gloo ranks
    in ONE launch (the ranks' start-up and model load paid once, not once a credit)."""
    credits = selected(request, "test_three_gloo_ranks_collect_the_same_fit_set_as_one_process", "credit")
    return launch_cpu(_collect_on_ranks, 3, credits, timeout_s=240) if credits else {}


@pytest.mark.parametrize("credit", CREDITS)
def test_three_gloo_ranks_collect_the_same_fit_set_as_one_process(runner, on_three_ranks, credit):
    col = Collector(runner, "chain_arith", SEATS, group=3, credit=credit, seed=4, chunk=2)
    exs, stats = col.collect(_items(7))
    want = json.dumps([dataclasses.asdict(e) for e in exs])
    for rank in range(3):
        got, got_stats = on_three_ranks[rank][credit]
        assert got == want, f"rank {rank} collected a different fit set"
        assert json.loads(got_stats)["per_group_outcomes"] == stats["per_group_outcomes"]


def test_fit_prompt_refits_messages_under_the_deployment_prompt(runner):
    col = Collector(runner, "chain_arith", [1, 2], group=2, credit="shared", seed=0,
                    fit_prompt="sequential_v2s")
    items = _items(2)
    exs, _ = col.collect(items)
    runs = runner.run(items, samples=2, seed=0)
    want = [(runner.prompt_text(k, it, r.texts[:k], mode="sequential_v2s"), r.texts[k] + "<|im_end|>" * r.finished[k])
            for it, rs in zip(items, runs) for r in rs for k in (1, 2)]
    assert [(e.prompt, e.target) for e in exs] == want        # collected message, deployment prompt
    assert all("<<<" in e.prompt for e in exs)


def test_a_message_that_ended_keeps_its_end_of_turn_token_and_a_cut_one_has_none(runner):
    """SFT and rSFT fit the targets: a message the model ended is fitted with the token that
    ended it (else fitting its own samples teaches a seat to talk on); one cut by the budget is
    not. Encoding maps the text back to the one token."""
    import dataclasses

    from admm_dist.model.batches import encode
    from admm_dist.model.objectives import ObjectiveConfig

    short = ChainRunner(runner.model, runner.tok, dataclasses.replace(runner.cfg, max_new_tokens=6))
    items = _items(6)
    for r in (runner, short):
        exs, _ = Collector(r, "chain_arith", SEATS, group=2, credit="shared", seed=0).collect(items)
        runs = r.run(items, samples=2, seed=0)
        ended = [ro.finished[k] for rs in runs for ro in rs for k in SEATS]
        assert [e.target.endswith("<|im_end|>") for e in exs] == ended
        assert [e.target.removesuffix("<|im_end|>") for e in exs] == [ro.texts[k] for rs in runs for ro in rs for k in SEATS]
        enc = encode(r.tok, exs, ObjectiveConfig(fit_mode="sft"))
        im_end = r.tok.convert_tokens_to_ids("<|im_end|>")
        assert len(enc) == len(exs) and [x.target_ids[-1] == im_end for x in enc] == ended
    assert any(ended) and not all(ended)     # the short budget cuts some messages, not all


class _Recording(Collector):
    """A collector that keeps the branches its collection made (one chunk: every query's)."""
    def branches(self, chunk):
        self.made = super().branches(chunk)
        return self.made


def test_prefix_samples_branches_from_a_right_prefix_when_one_exists(runner):
    items = _items(16)
    one = Collector(runner, "chain_arith", SEATS, group=2, credit="per_role", seed=3, downstream_seed=9)
    many = _Recording(runner, "chain_arith", SEATS, group=2, credit="per_role", seed=3, downstream_seed=9,
                      prefix_samples=4, chunk=len(items))
    probes = runner.run(items, samples=4, seed=3)
    right = [[tasks.score("chain_arith", r.final_text, it)[1] for r in rs] for it, rs in zip(items, probes)]
    _, st = many.collect(items)     # its branches, and its stats, from one collection
    by1, by4 = one.branches(items), many.made
    for i, it in enumerate(items):
        # the prefix is the first right one of the 4 probe chains, else the first chain (= P 1)
        want = probes[i][right[i].index(True)] if any(right[i]) else probes[i][0]
        for k in SEATS:
            assert all(tuple(c.texts[:k]) == tuple(want.texts[:k]) for c in by4[(i, k)])
            assert all(tuple(c.texts[:k]) == tuple(probes[i][0].texts[:k]) for c in by1[(i, k)])
    assert many._prefix_ok == [any(r) for r in right]
    assert sum(many._prefix_ok) > sum(one._prefix_ok)   # 16 queries: some first chains are wrong
    assert st["prefix_samples"] == 4 and st["prefix_right_rate"] == pytest.approx(sum(map(any, right)) / 16)


@pytest.mark.parametrize("kw, msg", [(dict(prefix_samples=0), "prefix_samples=0"),
                                     (dict(prefix_samples=2, credit="shared"), "per_role")])
def test_prefix_samples_needs_per_role_credit(runner, kw, msg):
    with pytest.raises(ValueError, match=msg):
        Collector(runner, "chain_arith", SEATS, **kw)
