"""A fit set into this rank's shards (:func:`admm_dist.training.pipeline.shard`): the held-out
split is taken from a run's first fit set only."""
from admm_dist.data.fitset import FitSet
from admm_dist.demo.synthetic import make_examples
from admm_dist.training import pipeline
from admm_dist.training.config import TrainConfig
from admm_dist.training.report import TrainReport


def _shard(fitset, hold_out, said=None, **kw):
    cfg = TrainConfig(task="synthetic", n_agents=4, model_name="unused", fit_mode="dpo", **kw)
    report = TrainReport()
    talk = (lambda m: None) if said is None else said.append
    shards, dev = pipeline.shard(cfg, fitset, range(4), report, talk, hold_out=hold_out)
    return shards, dev, report


def test_only_the_first_fit_set_gives_up_a_held_out_share():
    f = FitSet(make_examples(per_seat=20), "dpo", {"task": "synthetic", "n_agents": 4})
    all_in, none, _ = _shard(f, True)
    first, dev, report = _shard(f, True, dev_frac=0.25)
    later, later_dev, later_report = _shard(f, False, dev_frac=0.25)
    assert none == [] and len(dev) == report.dev_held_out == 20 and later_dev == []
    assert sum(map(len, first.values())) == 80 - 20
    assert later == all_in                    # a re-collection trains on every example
    assert later_report.node_sizes == [20] * 4 and "dev_held_out" not in later_report.as_dict()


def test_held_out_selection_under_re_collection_is_flagged_in_one_line():
    """-best under re-collection picked an early round on the stand-in (docs/benchmarks.md):
    a run that asks for both is told so once, when its first fit set is split."""
    f = FitSet(make_examples(per_seat=8), "dpo", {"task": "synthetic", "n_agents": 4})
    said, quiet = [], []
    _shard(f, True, said, dev_frac=0.25, recollect_every=2, anchor_split="train")
    _shard(f, True, quiet, dev_frac=0.25)
    notes = [m for m in said if m.startswith("note: dev_frac with recollect_every")]
    assert len(notes) == 1 and "deploy -last" in notes[0]
    assert not any(m.startswith("note: dev_frac") for m in quiet)
