"""What a resume restores beside the tensors (:mod:`admm_dist.training.resume`): the run's record
(:class:`~admm_dist.training.state.RunRecord`) of the collections so far and of every query
trained on, through its state_dict; the optimizer through its own."""
from admm_dist.training.report import TrainReport
from admm_dist.training.state import RunRecord

STATE = {"collections": [{"collection": c, "mean_pass_rate": 0.4 + c / 10} for c in range(3)],
         "anchor_keys_all": ["q0", "q1", "q2", "q3", "q4", "q5"],
         "dev_curve": [{"round": 2, "dev_nll": 1.5}]}


def _attempt():
    """A resumed attempt's record before the restore: it has read the first collection again."""
    r = RunRecord()
    r.add_collection({"collection": 0, "mean_pass_rate": 0.4}, ["q0", "q1"])
    return r


def test_the_collections_before_the_one_made_again_are_restored():
    r = _attempt()
    r.load_state_dict(STATE, before_collection=2)   # resumed after round 5, recollect_every 2: collection 2 again
    assert [c["collection"] for c in r.collections] == [0, 1]
    assert r.anchor_keys_all == STATE["anchor_keys_all"] and r.dev_curve == STATE["dev_curve"]
    r.add_collection({"collection": 2, "mean_pass_rate": 0.6}, ["q4", "q5"])   # made again: no duplicate keys
    assert [c["collection"] for c in r.collections] == [0, 1, 2] and r.anchor_keys_all == STATE["anchor_keys_all"]
    report = TrainReport()
    r.fill(report)                                   # the report copies the record: an output only
    assert report.anchor_keys == report.anchor_keys_all == STATE["anchor_keys_all"]
    assert [c["collection"] for c in report.collections] == [0, 1, 2]


def test_no_collection_made_again_keeps_every_one():
    """Resumed before the first re-collection, or after the last round: nothing is collected again."""
    r = _attempt()
    r.load_state_dict(dict(STATE, collections=STATE["collections"][:1], anchor_keys_all=["q0", "q1"]))
    assert [c["collection"] for c in r.collections] == [0]
    r = _attempt()
    r.load_state_dict(STATE)
    assert [c["collection"] for c in r.collections] == [0, 1, 2]
    again = RunRecord()
    again.load_state_dict(r.state_dict())            # the round trip a checkpoint makes
    assert again == r


def test_an_empty_record_leaves_the_attempts_own():
    """A checkpoint of a run that has collected nothing yet (its record is being made)."""
    r = _attempt()
    r.load_state_dict({"collections": [], "anchor_keys_all": [], "dev_curve": []}, before_collection=1)
    assert [c["collection"] for c in r.collections] == [0] and r.anchor_keys_all == ["q0", "q1"]
    report = TrainReport()
    r.fill(report)
    assert not report.is_set("dev_curve")            # no dev split: the field stays absent


def test_the_optimizer_goes_through_its_state_dict_and_keeps_the_current_learning_rate():
    """Adam's state is saved and restored through ``state_dict()``: a restored optimizer steps
    exactly as the saved one, under its own (possibly changed, ``eta``) learning rate."""
    import torch

    from admm_dist.training.resume import load_optimizer, optimizer_record

    torch.manual_seed(0)
    target = torch.randn(64)

    def steps(p, opt, n):
        for _ in range(n):
            opt.zero_grad()
            ((p - target) ** 2).sum().backward()
            opt.step()

    p = torch.nn.Parameter(torch.zeros(64))
    opt = torch.optim.Adam([p], lr=1e-2)
    steps(p, opt, 3)
    tensors, scalars = optimizer_record(opt)
    assert set(tensors) == {"adam.exp_avg", "adam.exp_avg_sq"} and scalars == {"step": 3.0}
    q = torch.nn.Parameter(p.detach().clone())
    again = torch.optim.Adam([q], lr=1e-2)
    load_optimizer(again, tensors, scalars, "cpu")
    steps(p, opt, 2)
    steps(q, again, 2)
    assert torch.equal(p, q)                                   # the same moments and step count
    lowered = torch.optim.Adam([torch.nn.Parameter(q.detach().clone())], lr=1e-3)
    load_optimizer(lowered, *optimizer_record(again), "cpu")
    assert lowered.param_groups[0]["lr"] == 1e-3              # eta changed on resume: the new one holds
    fresh = torch.optim.Adam([torch.nn.Parameter(torch.zeros(64))], lr=1e-2)
    assert optimizer_record(fresh) == ({}, {})                 # a node that never stepped
    load_optimizer(fresh, {}, {}, "cpu")
    assert fresh.state_dict()["state"] == {}
