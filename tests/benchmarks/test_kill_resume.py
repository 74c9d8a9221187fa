"""The kill-inside-a-checkpoint-write benchmark: its draws, its comparison and its leftovers check
(fast), and one real trial under torchrun (slow)."""
import json

import pytest
import torch
from safetensors.torch import save_file

from benchmarks import kill_resume as kr
from faults import POINTS


def test_the_trials_alternate_keep_and_draw_within_range_reproducibly():
    p = kr.plan(20, 0, 5)
    assert [t["keep"] for t in p] == [1, 3] * 10
    assert all(1 <= t["round"] <= 5 and 0 <= t["node"] < 4 and t["point"] in POINTS for t in p)
    assert p == kr.plan(20, 0, 5) and p != kr.plan(20, 1, 5)


def _results(folder, b, x):
    (folder / "runs" / "run").mkdir(parents=True)
    save_file({"b": b}, str(folder / "runs" / "run-last.safetensors"))
    for i in range(4):
        save_file({"x": x.clone(), "z": b.clone(), "u": b.clone()}, str(folder / "runs" / "run" / f"node-{i}.safetensors"))
    return kr.result_tensors(str(folder))


def test_bit_identical_means_every_byte_of_every_result_tensor(tmp_path):
    b = torch.tensor([1.0, float("nan"), 0.0])
    ref = _results(tmp_path / "a", b, b)
    assert kr.differences(_results(tmp_path / "b", b.clone(), b.clone()), ref) == []
    negzero = torch.tensor([1.0, float("nan"), -0.0])                        # == but not the same bits
    assert kr.differences(_results(tmp_path / "c", b, negzero), ref) == [f"node-{i}[x]: differs" for i in range(4)]
    (tmp_path / "b" / "runs" / "run" / "node-2.safetensors").unlink()
    assert kr.differences(kr.result_tensors(str(tmp_path / "b")), ref) == ["node-2: missing"]


def test_leftovers_are_temporaries_and_staged_results(tmp_path):
    (tmp_path / "runs" / "run.ckpt" / "round-000002").mkdir(parents=True)
    (tmp_path / "runs" / "run.ckpt" / "round-000002" / ".node-1.json.abc.tmp").write_text("")
    (tmp_path / "runs" / ".run-last.safetensors.staged").write_text("")
    (tmp_path / "runs" / "run.ckpt" / "round-000002" / "node-1.json").write_text("{}")
    assert kr.leftovers(str(tmp_path)) == ["runs/.run-last.safetensors.staged",
                                           "runs/run.ckpt/round-000002/.node-1.json.abc.tmp"]
    assert kr.rounds_left(str(tmp_path)) == [2]

SUMMARY = """E1203 08:39:21.357000 16806 .../multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 16811) of binary: python3
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
admm_dist.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-03_08:39:21
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 16812) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
[2]:
  time      : 2026-12-03_08:39:21
  host      : localhost
  rank      : 2 (local_rank: 2)
  exitcode  : 1 (pid: 16813) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
[3]:
  time      : 2026-12-03_08:39:21
  host      : localhost
  rank      : 3 (local_rank: 3)
  exitcode  : -9 (pid: 16814)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 16814
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_08:39:21
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 16811) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
"""


def test_the_killed_rank_is_read_from_torchruns_failure_summary_too(tmp_path):
    """Its peers fail within milliseconds of the killed rank, so torchrun may name one of them
    as the first observed failure; the summary still lists the SIGKILL (torchrun 2.13's text)."""
    log = tmp_path / "fault.log"
    log.write_text(SUMMARY)
    assert kr.killed_ranks(str(log)) == [3]
    log.write_text("E1203 api.py:1002] failed (exitcode: -9) local_rank: 2 (pid: 5) of binary: python3\n")
    assert kr.killed_ranks(str(log)) == [2]


@pytest.mark.slow
def test_a_killed_run_resumes_bit_identical(tmp_path, capsys):
    """keep_checkpoints 1, the 4 nodes on 2 ranks (two each): the rank holding node 3 is SIGKILLed
    inside node 3's checkpoint write of round 4, after it wrote node 2's; resume=auto ends bit for
    bit where the uninterrupted run ends (3 torchrun launches, about a minute on 2 cores; each
    launch bounded by --timeout). One node per rank, and keep_checkpoints 3, are the benchmark's
    20 trials (docs/benchmarks.md); the elastic tests (tests/launch/test_elastic.py,
    test_multinode.py) lose a host mid-run with keep_checkpoints 3."""
    summary = tmp_path / "summary.json"
    rc = kr.main(["--runs", "1", "--nproc", "2", "--out", str(tmp_path / "kr"), "--json", str(summary),
                  "--timeout", "300"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "1/1 bit-identical" in out
    r = json.loads(summary.read_text())
    assert r["settings"]["nproc"] == 2
    assert [(t["keep"], t["round"], t["node"], t["rank"]) for t in r["trials"]] == [(1, 4, 3, 1)]
    for t in r["trials"]:
        assert t["fault_rc"] != 0 and t["killed_ranks"] == [1] and t["resume_rc"] == 0, t
        assert t["identical"] and t["leftovers"] == [] and t["rounds_as_reference"], t
    assert r["summary"]["ok"] == 1


def test_nproc_must_fit_the_nodes(capsys):
    with pytest.raises(SystemExit):
        kr.main(["--nproc", "5"])
    assert "--nproc 5: use 1 to 4 ranks" in capsys.readouterr().err
