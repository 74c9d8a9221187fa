"""Fit-set files (JSONL, versioned, settings-checked), derivation, filters and node assignment."""
import json

import pytest

from admm_dist.core.errors import UserError
from admm_dist.core.text import visible
from admm_dist.data.derive import dedup_targets, derive, drop_unclosed_think, target_composition
from admm_dist.data.fitset import Example, FitSet, FitSetError, load_fitset, save_fitset, settings_key
from admm_dist.data.partition import by_seat, partition, split_dev

SETTINGS = {"task": "gsm8k", "n_agents": 4, "group": 8, "seed": 42, "fit_mode": "sft",
            "adapt_roles": "all"}
ROLES = ["Planner", "Critic", "Refiner", "Judger"]


def sft(seat, anchor, target, *, success=None, reward=0.0, advantage=0.0, prompt=None):
    return Example(seat=seat, role=ROLES[seat], anchor=anchor,
                   prompt=prompt if prompt is not None else f"<user>{anchor}</user>#{seat}",
                   target=target, reward=reward, advantage=advantage, success=success)


def sample_sft():
    exs = []
    for a in range(3):
        for g in range(4):
            ok = g % 2 == 0
            exs.append(sft(g % 2, f"q{a}", f"<think>r{a}{g}</think> answer {a}-{g} é",
                           success=ok, reward=float(ok), advantage=0.5 if ok else -0.5))
    return exs


def test_roundtrip(tmp_path):
    path = tmp_path / "fs.jsonl"
    exs = sample_sft()
    dpo = [Example(seat=1, role="Critic", anchor="q", prompt="p", target="good",
                   rejected="bad", rejected_prompt="p2", reward=1.0, rejected_reward=0.0,
                   advantage=1.0)]
    save_fitset(str(path), exs, fit_mode="sft", settings=SETTINGS, stats={"pass_rate": 0.5},
                anchor_keys=["q0", "q1", "q2"])
    fs = load_fitset(str(path), settings=dict(SETTINGS, fit_mode="dpo"))  # fit_mode ignored
    assert fs.examples == exs and fs.fit_mode == "sft"
    assert fs.settings == SETTINGS and fs.stats == {"pass_rate": 0.5}
    assert fs.anchor_keys == ["q0", "q1", "q2"]
    lines = path.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    assert header["format"] == "admm_dist.fitset" and header["version"] == 1
    assert header["n_examples"] == len(exs) == len(lines) - 1
    assert json.loads(lines[1])["target"] == exs[0].target
    assert not list(tmp_path.glob(".*.tmp"))          # atomic write left no temp file

    save_fitset(str(path), dpo, fit_mode="dpo", settings={})
    assert load_fitset(str(path)).examples == dpo
    with pytest.raises(FitSetError, match="needs a rejected"):
        save_fitset(str(path), exs, fit_mode="dpo", settings={})
    with pytest.raises(FitSetError, match="must not carry rejected"):
        save_fitset(str(path), dpo, fit_mode="sft", settings={})
    assert load_fitset(str(path)).examples == dpo      # failed saves left the file intact


def test_settings_mismatch_names_the_key(tmp_path):
    path = str(tmp_path / "fs.jsonl")
    save_fitset(path, sample_sft(), fit_mode="sft", settings=SETTINGS)
    with pytest.raises(FitSetError) as err:
        load_fitset(path, settings=dict(SETTINGS, group=16))
    msg = str(err.value)
    assert "group: 8 != 16" in msg and "(file, requested)" in msg and "n_agents" not in msg
    # a key missing on either side is a difference too
    with pytest.raises(FitSetError, match="init_sha: '<missing>' != 'abc'"):
        load_fitset(path, settings=dict(SETTINGS, init_sha="abc"))
    partial = {k: v for k, v in SETTINGS.items() if k != "seed"}
    with pytest.raises(FitSetError, match="seed: 42 != '<missing>'"):
        load_fitset(path, settings=partial)
    with pytest.raises(FitSetError, match="fit_mode"):
        load_fitset(path, settings=dict(SETTINGS, fit_mode="dpo"), ignore=())


def test_truncated_file(tmp_path):
    path = tmp_path / "fs.jsonl"
    save_fitset(str(path), sample_sft(), fit_mode="sft", settings=SETTINGS)
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_text("".join(lines[:-3]), encoding="utf-8")
    with pytest.raises(FitSetError, match=r"header says 12 examples but the file holds 9 .*truncated"):
        load_fitset(str(path))


def test_corrupt_line(tmp_path):
    path = tmp_path / "fs.jsonl"
    save_fitset(str(path), sample_sft(), fit_mode="sft", settings=SETTINGS)
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[4] = lines[4][:20] + "\n"
    path.write_text("".join(lines), encoding="utf-8")
    with pytest.raises(FitSetError, match=r"line 5 is not valid JSON"):
        load_fitset(str(path))
    path.write_text('{"format": "something.else", "version": 1}\n', encoding="utf-8")
    with pytest.raises(FitSetError, match="not an admm_dist.fitset file"):
        load_fitset(str(path))
    path.write_text('{"format": "admm_dist.fitset", "version": 2}\n', encoding="utf-8")
    with pytest.raises(FitSetError, match="version 2"):
        load_fitset(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(FitSetError, match="does not exist: collect it first or fix --fitset_cache"):
        load_fitset(str(tmp_path / "nope.jsonl"))


def test_derive_sft_rsft_dpo():
    exs = sample_sft()
    fs = FitSet(examples=exs, fit_mode="sft", settings={})
    assert derive(fs, "sft") == exs and derive(fs, "sft")[0] is not exs[0]
    rsft = derive(fs, "rsft")
    assert len(rsft) == 6 and all(e.success is True for e in rsft)

    # group (seat 0, q0, prompt) has 2 successes + 1 failure -> 2 pairs; unlabelled unused
    p = "<user>x</user>"
    grp = [sft(0, "x", "A", success=True, reward=1.0, advantage=0.6, prompt=p),
           sft(0, "x", "B", success=True, reward=1.0, advantage=0.4, prompt=p),
           sft(0, "x", "C", success=False, reward=0.0, advantage=-0.5, prompt=p),
           sft(0, "x", "D", success=None, prompt=p),
           sft(0, "x", "E", success=False, prompt="other prompt"),   # no partner: no pair
           sft(1, "x", "F", success=False, prompt=p)]               # other seat: no pair
    pairs = derive(FitSet(examples=grp, fit_mode="sft", settings={}), "dpo")
    assert [(e.target, e.rejected) for e in pairs] == [("A", "C"), ("B", "C")]
    assert pairs[0].reward == 1.0 and pairs[0].rejected_reward == 0.0
    assert pairs[0].advantage == pytest.approx(1.1) and pairs[0].prompt == p
    assert derive(FitSet(examples=grp, fit_mode="sft", settings={}), "dpo") == pairs
    # from the sample: every (seat, anchor) group has 2 successes for seat 0 and 2 failures
    # for seat 1 -> no cross-seat pairs
    assert derive(fs, "dpo") == []

    dfs = FitSet(examples=pairs, fit_mode="dpo", settings={})
    assert derive(dfs, "dpo") == pairs
    with pytest.raises(FitSetError, match="cannot derive 'sft' examples from a 'dpo' fit set"):
        derive(dfs, "sft")
    with pytest.raises(FitSetError, match="no success labels"):
        derive(FitSet(examples=[sft(0, "q", "t")], fit_mode="sft", settings={}), "rsft")


def test_drop_unclosed_think_and_visible():
    exs = [sft(0, "q", "<think>a</think> ok"),
           sft(0, "q", "<think>cut off"),
           sft(0, "q", "no think at all"),
           sft(0, "q", "<think>a</think> x <think>second never closed"),
           Example(seat=0, role="P", anchor="q", prompt="p", target="fine",
                   rejected="<think>bad")]
    kept, n = drop_unclosed_think(exs)
    assert n == 3 and [e.target for e in kept] == ["<think>a</think> ok", "no think at all"]
    assert visible("<think>a</think>  B </think> C ").strip() == "C"     # after the LAST one
    assert visible("  plain ").strip() == "plain"


def test_dedup_cap_keeps_highest_advantage():
    exs = [sft(0, "q1", "<think>x</think> same", advantage=0.1),
           sft(0, "q2", "<think>y</think>same", advantage=0.9),
           sft(0, "q3", "other", advantage=0.0),
           sft(0, "q4", "same", advantage=0.5),
           sft(1, "q5", "same", advantage=-1.0)]        # seat 1 counts separately
    out = dedup_targets(exs, 2)
    assert out == [exs[1], exs[2], exs[3], exs[4]]      # original order, lowest 'same' gone
    assert dedup_targets(exs, 1) == [exs[1], exs[2], exs[4]]
    assert dedup_targets(exs, 0) == exs
    # with nodes set, grouping is by node: seats 0 and 1 on one node share the cap
    for e in exs:
        e.node = 0
    assert dedup_targets(exs, 1) == [exs[1], exs[2]]
    with pytest.raises(FitSetError):
        dedup_targets(exs, -1)


def test_dedup_key_is_the_text_after_the_last_think_close():
    exs = [sft(0, "q1", "<think>a</think> B </think> C ", advantage=0.9),
           sft(0, "q2", "C", advantage=0.5),
           sft(0, "q3", "<think>b</think> B </think> D", advantage=0.1)]
    assert dedup_targets(exs, 1) == [exs[0], exs[2]]      # "C" == "C"; "D" differs
    assert target_composition([exs])[0]["distinct"] == 2
    assert issubclass(FitSetError, UserError) and issubclass(FitSetError, ValueError)


def test_target_composition():
    node0 = [sft(0, "a", "<think>1</think> X"), sft(0, "b", "X"), sft(0, "c", "Y"),
             sft(0, "d", "X ")]
    stats = target_composition([node0, []])
    assert stats == [{"node": 0, "n": 4, "distinct": 2, "top_share": 0.75},
                     {"node": 1, "n": 0, "distinct": 0, "top_share": 0.0}]


def test_split_dev_deterministic_and_disjoint():
    per_node = [[sft(0, f"q{i}", f"t{i}") for i in range(10)],
                [sft(1, f"q{i}", f"u{i}") for i in range(7)]]
    train, dev = split_dev(per_node, 0.3, seed=42)
    train2, dev2 = split_dev(per_node, 0.3, seed=42)
    assert [[id(e) for e in f] for f in train] == [[id(e) for e in f] for f in train2]
    assert [id(e) for e in dev] == [id(e) for e in dev2]
    assert [len(f) for f in train] == [7, 5] and len(dev) == 3 + 2   # round(3.0), round(2.1)
    for t, orig in zip(train, per_node):
        assert {id(e) for e in t}.isdisjoint(id(e) for e in dev)
        assert t == [e for e in orig if any(e is x for x in t)]       # order kept
    assert {id(e) for f in train for e in f} | {id(e) for e in dev} == \
        {id(e) for f in per_node for e in f}
    assert sum(e.seat == 1 for e in dev) == 2                        # every node contributes
    _, dev_other = split_dev(per_node, 0.3, seed=7)
    assert [id(e) for e in dev_other] != [id(e) for e in dev]
    assert split_dev(per_node, 0.0, seed=1) == (per_node, [])
    for bad in (1.0, -0.1):
        with pytest.raises(FitSetError, match=r"\[0, 1\)"):
            split_dev(per_node, bad, seed=1)


def test_partition_anchor_stable_and_thin_node_error():
    per_seat = [[sft(s, f"q{a}", f"t{s}{a}") for a in range(40)] for s in range(2)]
    parts = partition(per_seat, mode="anchor", n_partitions=3, min_examples=4)
    again = partition(per_seat, mode="anchor", n_partitions=3, min_examples=4)
    assert [[e.target for e in p] for p in parts] == [[e.target for e in p] for p in again]
    assert sum(len(p) for p in parts) == 80 and len(parts) == 3
    import hashlib
    for j, p in enumerate(parts):
        for e in p:
            assert e.node == j
            assert int(hashlib.sha1(e.anchor.encode()).hexdigest(), 16) % 3 == j
    # one query's examples all land on one node
    assert len({e.node for p in parts for e in p if e.anchor == "q5"}) == 1
    assert len(partition(per_seat, mode="anchor", min_examples=1)) == 2   # default n = seats
    few = [[sft(0, f"q{a}", "t") for a in range(5)]]
    with pytest.raises(FitSetError, match=r"nodes \[.*\] hold fewer than 16.*fewer partitions"):
        partition(few, mode="anchor", n_partitions=4)
    seat = partition(per_seat)
    assert seat == per_seat and all(e.node == j for j, p in enumerate(seat) for e in p)


def test_pooled():
    per_seat = [[sft(0, "a", "x"), sft(0, "b", "y")], [sft(1, "a", "z")]]
    out = partition(per_seat, pooled=True)
    assert len(out) == 1 and [e.target for e in out[0]] == ["x", "y", "z"]
    assert all(e.node == 0 for e in out[0])
    with pytest.raises(FitSetError, match="exclude each other"):
        partition(per_seat, pooled=True, mode="anchor")


def test_by_seat():
    exs = [sft(2, "a", "x"), sft(0, "a", "y"), sft(3, "b", "w"), sft(2, "b", "z")]
    with pytest.raises(FitSetError, match=r"seats \[3\].*adapted seats \[0, 2\]"):
        by_seat(exs, [0, 2])
    nodes = by_seat(exs, [2, 0], drop_others=True)
    assert [[e.target for e in n] for n in nodes] == [["x", "z"], ["y"]]
    assert [[e.target for e in n] for n in by_seat(exs, [0, 2, 3, 1])] == \
        [["y"], ["x", "z"], ["w"], []]
    with pytest.raises(FitSetError, match="twice"):
        by_seat(exs, [0, 0])


def test_settings_key_stable():
    a = settings_key({"b": 1, "a": [1, 2], "c": "é"})
    assert a == settings_key({"c": "é", "a": [1, 2], "b": 1}) and len(a) == 64
    assert a != settings_key({"b": 2, "a": [1, 2], "c": "é"})


def test_a_line_over_its_ceiling_is_refused_before_it_is_parsed(tmp_path):
    """A 20 MB prompt aborted the tokenizer (rc 134): a line over MAX_FITSET_LINE_BYTES is refused
    while the file is read (here 1 MiB + 1), and save_fitset refuses to write one."""
    from admm_dist.core.constants import MAX_FITSET_LINE_BYTES
    path = tmp_path / "fs.jsonl"
    save_fitset(str(path), sample_sft(), fit_mode="sft", settings=SETTINGS)
    lines = path.read_text(encoding="utf-8").splitlines()
    fits = json.loads(lines[2])
    fits["prompt"] = ""
    fits["prompt"] = "p" * (MAX_FITSET_LINE_BYTES - len(json.dumps(fits)))     # exactly at the ceiling
    lines[2] = json.dumps(fits)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert len(load_fitset(str(path)).examples[1].prompt) > MAX_FITSET_LINE_BYTES - 300
    lines[2] = json.dumps(dict(fits, prompt=fits["prompt"] + "p"))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(FitSetError) as err:
        load_fitset(str(path))
    assert str(err.value) == (
        f"{path}: line 3 is longer than {MAX_FITSET_LINE_BYTES} bytes, the ceiling of a fit-set line "
        "(MAX_FITSET_LINE_BYTES): no example is that long; the file is not one admm_dist wrote, or was edited: "
        "rebuild the fit set")
    big = sft(0, "q", "t", prompt="p" * MAX_FITSET_LINE_BYTES)
    with pytest.raises(FitSetError, match=r"example 1 is \d+ bytes as a fit-set line, over the ceiling 1048576"):
        save_fitset(str(tmp_path / "big.jsonl"), [sft(0, "q", "t"), big], fit_mode="sft", settings=SETTINGS)
    assert not (tmp_path / "big.jsonl").exists()
