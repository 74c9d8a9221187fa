"""Which rows train and which evaluate: seeded pool order, fresh slices, the leakage refusal."""
import pytest

from admm_dist.data import queries


def test_pool_is_a_seeded_shuffle_of_the_task():
    a = queries.pool("chain_arith", seed=1, n=50)
    assert a == queries.pool("chain_arith", seed=1, n=50)
    assert a != queries.pool("chain_arith", seed=2, n=50)
    assert sorted(x["anchor"] for x in a) == sorted(x["anchor"] for x in queries.pool("chain_arith", seed=2, n=50))


def test_training_slices_come_from_the_end_and_never_repeat():
    rows = list(range(20))
    items = [{"anchor": str(i)} for i in rows]
    first = queries.training_slice(items, 5)
    second = queries.training_slice(items, 5, collection=1)
    assert [x["anchor"] for x in first] == ["15", "16", "17", "18", "19"]
    assert [x["anchor"] for x in second] == ["10", "11", "12", "13", "14"]
    assert [x["anchor"] for x in queries.training_slice(items, 5, offset=2, collection=1)] == \
        ["7", "8", "9", "10", "11"]
    with pytest.raises(ValueError, match="do not fit"):
        queries.training_slice(items, 5, collection=3)     # would leave no evaluation row
    with pytest.raises(ValueError, match="exceeds"):
        queries.training_slice(items, 5, offset=18)
    # recollect_anchors: a first slice of 5, then slices of 3, still disjoint and towards the front
    keys = [[x["anchor"] for x in queries.training_slice(items, 3, first=5, collection=c)] for c in range(3)]
    assert keys == [["15", "16", "17", "18", "19"], ["12", "13", "14"], ["9", "10", "11"]]
    assert [x["anchor"] for x in queries.training_slice(items, 3, first=5, offset=0, collection=2)] == \
        ["8", "9", "10"]
    with pytest.raises(ValueError, match="20 training queries .* do not fit"):
        queries.training_slice(items, 3, first=5, collection=5)
    front = queries.evaluation_rows(items, 4)
    assert [x["anchor"] for x in front] == ["0", "1", "2", "3"]
    queries.refuse_leaks(front, [x["anchor"] for x in first])   # disjoint: fine
    with pytest.raises(ValueError, match="1 of 4 evaluation rows"):
        queries.refuse_leaks(front, ["2", "99"])


def test_chain_arith_pools_hold_more_than_400_rows_for_tight_evaluations():
    from admm_dist.tasks.chain_arith import POOL, load_chain_arith, split_of

    ev = queries.pool("chain_arith", seed=42)
    tr = queries.pool("chain_arith", seed=42, split="train")
    assert len(ev) == len(tr) == POOL >= 2000
    rows = queries.evaluation_rows(ev, 1500)
    assert len({r["anchor"] for r in rows}) == 1500 and all(split_of(r) == "eval" for r in rows)
    assert not {r["anchor"] for r in ev} & {r["anchor"] for r in tr}
    # a longer pool extends a shorter one: the first rows do not depend on n
    assert load_chain_arith("eval", n=400) == load_chain_arith("eval")[:400]


def test_n_ops_sets_the_operations_of_the_arithmetic_tasks_and_is_refused_elsewhere():
    """word_arith has 146 one-operation evaluation problems; with n_ops = 2 its pool holds many
    more, each of two operations, the evaluation and training splits still disjoint."""
    from admm_dist.core.errors import UserError
    from admm_dist.training.config import TrainConfig

    one = queries.pool("word_arith", seed=3)
    two = queries.pool("word_arith", seed=3, n_ops=2)
    train = queries.pool("word_arith", seed=3, n_ops=2, split="train")
    assert len(one) < 200 < len(two) and all(len(r["ops"]) == 1 for r in one) and all(len(r["ops"]) == 2 for r in two)
    assert not {r["anchor"] for r in two} & {r["anchor"] for r in train}
    assert queries.pool("chain_arith", seed=3, n=20, n_ops=3) == queries.pool("chain_arith", seed=3, n=20)
    with pytest.raises(UserError, match="n_ops=2 is for chain_arith and word_arith, not task gsm8k: drop n_ops"):
        queries.pool("gsm8k", seed=0, n_ops=2)
    with pytest.raises(UserError, match=r"n_ops=0: use an integer from 1 to 16"):
        TrainConfig(task="word_arith", n_ops=0)
    with pytest.raises(UserError, match="not task synthetic: drop n_ops"):
        TrainConfig(task="synthetic", n_ops=2)
    assert TrainConfig(task="word_arith", n_ops=2).n_ops == 2
