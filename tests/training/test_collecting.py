"""A run's collections as the report, the trackers, the log and ``fitset_cache`` see them
(the rollouts themselves: tests/training/test_trainer_onpolicy.py and tests/mas/test_collection.py)."""
from admm_dist.data.fitset import Example, FitSet, load_fitset
from admm_dist.training.collecting import record_collection
from admm_dist.training.config import TrainConfig
from admm_dist.training.report import TrainReport
from admm_dist.training.state import RunRecord
from admm_dist.training.tracking import Tracker


class _Scalars:
    """A tracker's writer that keeps what it is given (TensorBoard's and W&B's: test_tracking.py)."""
    def __init__(self):
        self.logged = []

    def log(self, step, scalars):
        self.logged.append((step, dict(scalars)))


def _fitset(n: int, collection: int) -> FitSet:
    examples = [Example(seat=i % 2, role=("Planner", "Critic")[i % 2], anchor=f"q{collection}-{i}",
                        prompt=f"p{i}", target=f"t{i}", reward=1.0, success=True) for i in range(n)]
    stats = {"collection": collection, "queries": 8, "kept_queries": 6, "examples": n, "mean_pass_rate": 0.5,
             "mixed_group_rate": 0.25, "seconds": 1.5, "prescreen": {"kept": 6}}
    return FitSet(examples, "sft", {"task": "synthetic", "n_agents": 2}, stats, [e.anchor for e in examples])


def test_each_collection_is_reported_tracked_at_its_round_and_only_the_first_is_cached(tmp_path):
    cfg = TrainConfig(out=str(tmp_path / "run"), fitset_cache=str(tmp_path / "fit.jsonl"), recollect_every=4,
                      group=4, credit="per_role")
    report, writer, lines = TrainReport(config={}, out_path=cfg.out), _Scalars(), []
    record = RunRecord()
    for c, n in ((0, 4), (1, 2)):
        record_collection(cfg, _fitset(n, c), c, record=record, report=report, tracker=Tracker([writer]),
                          talk=lines.append, rank=0)
    assert [s["examples"] for s in record.collections] == [4, 2]
    assert record.anchor_keys_all == [f"q0-{i}" for i in range(4)] + ["q1-0", "q1-1"]
    assert report.fitset_provenance == "collected"
    # at the round each collection ran after: 0, then recollect_every
    assert [step for step, _ in writer.logged] == [0, 4]
    assert writer.logged[1][1]["collection/mean_pass_rate"] == 0.5
    assert writer.logged[1][1]["collection/prescreen_kept"] == 6.0 and "collection/collection" not in writer.logged[1][1]
    assert lines[0] == "collection 0: 6/8 queries x 4 (per_role), 4 examples, pass rate 0.500, mixed groups 0.250 (1.5s)"
    assert f"wrote the collected fit set to {cfg.fitset_cache}" in lines
    cached = load_fitset(cfg.fitset_cache)        # the first collection, not the later one
    assert [e.anchor for e in cached.examples] == [f"q0-{i}" for i in range(4)]
    assert sum("wrote the collected fit set" in line for line in lines) == 1


def test_only_rank_0_writes_the_cache(tmp_path):
    cfg = TrainConfig(out=str(tmp_path / "run"), fitset_cache=str(tmp_path / "fit.jsonl"))
    report, record = TrainReport(config={}, out_path=cfg.out), RunRecord()
    record_collection(cfg, _fitset(2, 0), 0, record=record, report=report, tracker=Tracker(), talk=lambda m: None,
                      rank=1)
    assert not (tmp_path / "fit.jsonl").exists() and len(record.collections) == 1
