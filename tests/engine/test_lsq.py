"""The engine's end-to-end job, as a user runs it: in one process and under torchrun (its elastic
agent, from the launcher)."""
import json
import sys

import pytest

from admm_dist.cli import lsq


def test_single_process_job_writes_its_telemetry(tmp_path, capsys):
    out = tmp_path / "lsq.json"
    assert lsq.main(["--nodes", "3", "--k_outer", "40", "--json", str(out), "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert max(summary["rel_error_to_optimum"]) < 1e-4
    data = json.loads(out.read_text())
    assert len(data["rounds"]) == 40 and data["summary"] == summary


def test_torchrun_job_matches_the_single_process_job(tmp_path, monkeypatch):
    from admm_dist.bench.launcher import launch_cpu

    # torchrun's elastic agent from the launcher: 3 ranks of the command's main, without an
    # interpreter (and its torch import) to start per rank and for the agent
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "dist.json"
    argv = ["--consensus", "decentralized", "--topology", "chain", "--compress", "int8",
            "--k_outer", "20", "--timeout_s", "30", "--json", str(out), "--quiet"]
    assert launch_cpu(_lsq_rank, 3, argv, timeout_s=60, setup=False) == {0: None, 1: None, 2: None}
    ref = tmp_path / "ref.json"
    assert lsq.main(["--nodes", "3", "--consensus", "decentralized", "--topology", "chain", "--compress", "int8",
                     "--k_outer", "20", "--json", str(ref), "--quiet"]) == 0
    got, want = json.loads(out.read_text()), json.loads(ref.read_text())
    assert got["summary"]["rel_error_to_optimum"] == want["summary"]["rel_error_to_optimum"]
    assert [r["bytes_sent"] for r in got["rounds"]] == [r["bytes_sent"] for r in want["rounds"]]


def _lsq_rank(argv):
    """One rank of ``torchrun -m admm_dist.cli.lsq ARGV`` under launch_cpu (no interpreter start-up)."""
    rc = lsq.main(argv)
    if rc:
        sys.exit(rc)


def test_nodes_must_match_the_world_size(monkeypatch, capfd):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from admm_dist.bench.launcher import launch_cpu

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(ChildFailedError):
        launch_cpu(_lsq_rank, 2, ["--nodes", "3", "--timeout_s", "20"], timeout_s=60, setup=False)
    out, err = capfd.readouterr()
    assert "--nodes 3 != world size 2" in out + err
