"""The task registry, the synthetic chain-arithmetic task and number scoring."""
import pytest

from admm_dist import tasks
from admm_dist.tasks.chain_arith import apply_op, split_of
from admm_dist.tasks.scoring import extract_number, score


def test_registry_resolves_and_rejects_names():
    spec = tasks.get("chain_arith")
    assert spec.answer_type == "number"
    with pytest.raises(ValueError, match="choose one of"):
        tasks.get("gsm9k")


def test_chain_arith_is_deterministic_and_splits_never_share_a_row():
    a = tasks.load("chain_arith", split="train", n=2000, seed=3)
    b = tasks.load("chain_arith", split="train", n=2000, seed=3)
    assert a == b
    ev = tasks.load("chain_arith", split="eval", n=400, seed=3)
    assert len({i["question"] for i in a}) == 2000
    assert not {i["question"] for i in a} & {i["question"] for i in ev}
    assert all(split_of(i) == "eval" for i in ev)


def test_every_seat_does_real_work():
    items = tasks.load("chain_arith", split="eval", n=300, seed=1)
    for it in items:
        value = it["start"]
        for op, step in zip(it["ops"], it["steps"]):
            new = apply_op(value, op[0], int(op[1:]))
            assert new == step and new != value  # no identity step: copying is wrong
            value = new
        assert it["gold"] == str(value)
        # a chain in which any one seat copies its input ends with a wrong final answer
        for skip in range(len(it["ops"])):
            v = it["start"]
            for k, op in enumerate(it["ops"]):
                if k != skip:
                    v = apply_op(v, op[0], int(op[1:]))
            assert str(v) != it["gold"], it


@pytest.mark.parametrize("text,gold,ok", [
    ("<think>37+5=42, then 40</think> The answer is 42.", "42", True),
    ("so -12", "-12", True),
    ("1,234.50", "1234.5", True),
    ("<think>42</think> I think 41", "42", False),
    ("no number", "3", False),
])
def test_number_scoring(text, gold, ok):
    assert score(text, gold, "number")[1] is ok


def test_extract_number_normalizes():
    assert extract_number("x = 7.0") == "7"
    assert extract_number("") is None


def test_chain_arith_has_its_own_scorer():
    item = tasks.load("chain_arith", split="eval", n=1, seed=0)[0]
    gold = item["gold"]
    assert tasks.score("chain_arith", f"Answer: {gold}", item) == (gold, True)
    # a last seat that does one more step instead of answering has not answered
    assert tasks.score("chain_arith", f"3+{gold}={int(gold) + 3}", item) == (None, False)
    assert tasks.score("chain_arith", f"Answer: {int(gold) + 1}", item)[1] is False
    assert tasks.get("chain_arith").words == "compact"
    with pytest.raises(ValueError, match="reads no file"):
        tasks.load("chain_arith", path="x.jsonl")


def test_word_arith_asks_chain_arith_problems_in_words_on_the_same_splits():
    tr, ev = tasks.load("word_arith", split="train", seed=0), tasks.load("word_arith", split="eval", seed=0)
    assert len(tr) + len(ev) == 760 and len(ev) > 100            # every one-operation problem, once
    assert not {i["anchor"] for i in tr} & {i["anchor"] for i in ev}
    assert tasks.load("word_arith", split="eval", seed=0, n=5) == ev[:5]
    assert tasks.load("word_arith", split="eval", seed=1) != ev     # the seed orders the rows
    it = next(i for i in ev if i["ops"][0][0] == "*")
    assert it["question"] == f"What is {it['start']} times {it['ops'][0][1:]}?"
    assert it["gold"] == str(it["start"] * int(it["ops"][0][1:]))
    # a pretrained model's free text is scored on its last number (no 'Answer:' line needed)
    assert tasks.score("word_arith", f"So {it['start']} times 2... the result is {it['gold']}.", it)[1]
    assert not tasks.score("word_arith", f"{it['gold']} is not right, it is {int(it['gold']) + 1}", it)[1]
    two = tasks.load("word_arith", split="eval", seed=0, n=3, n_ops=2)
    assert two[0]["question"].startswith("Start with ") and ", then " in two[0]["question"]
    with pytest.raises(ValueError, match="ask for 1 to"):
        tasks.load("word_arith", split="eval", n=10_000)
    with pytest.raises(ValueError, match="reads no file"):
        tasks.load("word_arith", split="eval", path="rows.jsonl")
