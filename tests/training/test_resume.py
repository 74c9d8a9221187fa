"""What a resume restores beside the tensors (:mod:`admm_dist.training.resume`): the report's
record of the collections so far and of every query trained on."""
from admm_dist.training.report import TrainReport
from admm_dist.training.resume import restore_collections

META = {"collections": [{"collection": c, "mean_pass_rate": 0.4 + c / 10} for c in range(3)],
        "anchor_keys_all": ["q0", "q1", "q2", "q3", "q4", "q5"]}


def _attempt():
    """A resumed attempt's report before the restore: it has read the first collection again."""
    r = TrainReport()
    r.add_collection({"collection": 0, "mean_pass_rate": 0.4}, ["q0", "q1"])
    return r


def test_the_collections_before_the_one_made_again_are_restored():
    r = _attempt()
    restore_collections(r, META, 2)          # resumed after round 5, recollect_every 2: collection 2 again
    assert [c["collection"] for c in r.collections] == [0, 1]
    assert r.anchor_keys_all == META["anchor_keys_all"] and r.anchor_keys == META["anchor_keys_all"]
    r.add_collection({"collection": 2, "mean_pass_rate": 0.6}, ["q4", "q5"])   # made again: no duplicate keys
    assert [c["collection"] for c in r.collections] == [0, 1, 2] and r.anchor_keys_all == META["anchor_keys_all"]


def test_no_collection_made_again_keeps_every_one():
    """Resumed before the first re-collection, or after the last round: nothing is collected again."""
    r = _attempt()
    restore_collections(r, {"collections": META["collections"][:1], "anchor_keys_all": ["q0", "q1"]}, None)
    assert [c["collection"] for c in r.collections] == [0]
    r = _attempt()
    restore_collections(r, META, None)
    assert [c["collection"] for c in r.collections] == [0, 1, 2]


def test_an_empty_record_leaves_the_report_as_it_is():
    """A checkpoint of a run that has collected nothing yet (its record is being made)."""
    r = _attempt()
    restore_collections(r, {"collections": [], "anchor_keys_all": []}, 1)
    assert [c["collection"] for c in r.collections] == [0] and r.anchor_keys_all == ["q0", "q1"]
