"""The placement benchmark: its figures from a report, its hash of a result's tensors, its
refusals (fast), and a real run of the tiny backbone at W = 1 (plain python) and W = 2
(torchrun) whose results hash alike (about 30 s on 2 cores)."""
import hashlib
import json

import pytest
import torch
from conftest import REPO
from safetensors.torch import save_file

from benchmarks import placement as pl
from benchmarks import placement_memory as pm


def test_the_hash_is_of_the_tensors_bytes_in_key_order_not_of_the_file(tmp_path):
    a, b = torch.tensor([1.0, -0.0, float("nan")]), torch.arange(6, dtype=torch.int64).reshape(2, 3)
    save_file({"b": b, "a": a}, str(tmp_path / "x.safetensors"), metadata={"out": "here"})
    save_file({"a": a, "b": b}, str(tmp_path / "y.safetensors"), metadata={"out": "elsewhere"})
    hx, hy = pl.tensors_sha256(str(tmp_path / "x.safetensors")), pl.tensors_sha256(str(tmp_path / "y.safetensors"))
    want = hashlib.sha256(a.numpy().tobytes() + b.numpy().tobytes()).hexdigest()
    assert hx["sha256"] == hy["sha256"] == want
    assert hx["tensors"] == {"a": ["float32", [3]], "b": ["int64", [2, 3]]}
    save_file({"a": torch.tensor([1.0, 0.0, float("nan")]), "b": b}, str(tmp_path / "z.safetensors"))
    assert pl.tensors_sha256(str(tmp_path / "z.safetensors"))["sha256"] != want      # -0.0 is not 0.0


def test_a_round_lasts_as_long_as_its_slowest_node():
    rounds = [{"sec_x": [1.0, 1.0, 3.0, 3.0], "sec_z": [0.5, 0.5, 0.1, 0.1], "sec_other": [0.0, 0.0, 0.1, 0.1],
               "bytes_sent": [10, 10, 10, 10], "bytes_recv": [10, 10, 10, 10], "bytes_in_process": [5, 0, 5, 0]},
              {"sec_x": [2.0, 2.0, 1.0, 1.0], "sec_z": [0.0, 0.0, 0.5, 0.5], "sec_other": [0.0, 0.0, 0.0, 0.0],
               "bytes_sent": [20, 20, 20, 20], "bytes_recv": [20, 20, 20, 20], "bytes_in_process": [1, 1, 1, 1]}]
    f = pl.report_figures({"rounds": rounds, "placement": [[0, 1], [2, 3]], "train_sec": 9.5,
                           "collections": [{"seconds": 1.25}, {"seconds": 2.0}]})
    assert f["round_s_each"] == pytest.approx([3.2, 2.0])
    assert f["round_s"] == pytest.approx(2.6)
    assert f["x_s"] == pytest.approx(2.5) and f["z_s"] == pytest.approx(0.5)
    assert (f["wire_bytes_per_round"], f["in_process_bytes_per_round"]) == (60, 7)
    assert (f["wire_bytes_total"], f["wire_bytes_recv_total"], f["in_process_bytes_total"]) == (120, 120, 14)
    assert (f["collections"], f["collect_s"], f["train_s"], f["rounds"]) == (2, 3.25, 9.5, 2)
    assert pl.report_figures({"rounds": rounds})["collect_s"] is None       # a fit set from a file


def test_the_command_is_plain_python_at_one_rank_and_torchrun_above():
    one = pl.command(1, "c.yaml", "D/w1", ["k_outer=2"])
    assert one[1:] == ["-m", "admm_dist.train", "--config", "c.yaml", "k_outer=2", "out=D/w1/run",
                       "report_dir=D/w1/reports", "overwrite=true"]
    two = pl.command(2, "c.yaml", "D/w2", [])
    assert two[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]


@pytest.mark.parametrize("argv, msg", [
    (["out=x"], "out= and report_dir= are the benchmark's"),
    (["k_outer"], "write key=value"),
    (["--worlds", "1,0"], "distinct world sizes of at least 1"),
    (["--config", "nope.yaml"], "nope.yaml does not exist"),
    (["--memory-ks", "2,4"], "--memory-ks must include 1"),
])
def test_bad_arguments_are_refused_before_any_run(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        pl.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def _overrides(assets, **kw):
    d = dict(model_name=assets["backbone"], fitset_cache=assets["fit"], task="synthetic", n_agents=4,
             device="cpu", k_outer=2, local_steps=2, batch_size=4, eta=0.02, timeout_s=60)
    d.update(kw)
    return [f"{k}={v}" for k, v in d.items()]


@pytest.mark.slow
def test_one_and_two_ranks_give_the_same_result(tiny_assets, tmp_path, capsys):
    """The tiny backbone on the CPU ring config, 4 nodes: W = 1 (one process, four nodes) and
    W = 2 (torchrun, blocks of 2) hash alike; the table and the JSON hold the figures."""
    summary = tmp_path / "placement.json"
    rc = pl.main(["--worlds", "1,2", "--config", str(REPO / "configs" / "cpu" / "admm_ring.yaml"),
                  "--out", str(tmp_path / "runs"), "--json", str(summary), "--timeout", "240", "--memory", "none",
                  *_overrides(tiny_assets(4))])
    out = capsys.readouterr().out
    assert rc == 0, out
    r = json.loads(summary.read_text())
    assert r["same_sha256"] and len(r["sha256"]) == 64
    w1, w2 = r["runs"]
    assert (w1["world"], w1["launcher"], w1["placement"]) == (1, "python", [[0, 1, 2, 3]])
    assert (w2["world"], w2["launcher"], w2["placement"]) == (2, "torchrun", [[0, 1], [2, 3]])
    for w in (w1, w2):
        assert w["sha256"] == r["sha256"] and w["rounds"] == 2 and len(w["round_s_each"]) == 2
        assert w["wall_s"] > w["train_s"] > w["round_s"] * 2 > 0
        assert w["x_s"] > 0 and w["collect_s"] is None        # the fit set is a file: no collection
        assert w["tensors"]["b"][0] == "float32"
    # a ring of 4: at W = 1 (plain python) the single-process communicator meters what each node
    # would send; at W = 2 the hops 1->2 and 3->0 cross ranks, 0->1 and 2->3 stay in memory
    assert (w1["backend"], w1["wire_simulated"], w1["in_process_bytes_total"]) == ("LocalCommunicator", True, 0)
    assert (w2["backend"], w2["wire_simulated"]) == ("ProcessGroupCommunicator", False)
    assert w2["wire_bytes_total"] == w2["in_process_bytes_total"] == w2["wire_bytes_recv_total"] > 0
    assert w1["wire_bytes_total"] == w2["wire_bytes_total"] + w2["in_process_bytes_total"]
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in (["1", "python"], ["2", "torchrun"])]
    assert [row[:3] for row in rows] == [["1", "python", "4"], ["2", "torchrun", "2,2"]]
    assert all(row[-1] == r["sha256"] for row in rows)
    assert rows[0][-4].endswith("*") and not rows[1][-4].endswith("*")      # the simulated bytes are marked
    assert f"the same at every W ({r['sha256']})" in out


def test_a_failed_run_stops_the_benchmark_with_one_line_and_its_log(tiny_assets, tmp_path, capsys):
    overrides = _overrides(tiny_assets(4), no_such_key=1)
    capsys.readouterr()      # building the assets (first use in this process) prints a progress bar
    rc = pl.main(["--worlds", "1", "--config", str(REPO / "configs" / "cpu" / "admm_ring.yaml"),
                  "--out", str(tmp_path / "runs"), "--memory", "none", *overrides])
    err = capsys.readouterr().err
    assert rc == 2
    first = err.splitlines()[0]
    assert first.startswith("placement: error: W=1: the training command exited 2 after ")
    assert "no_such_key" in first and str(tmp_path / "runs" / "w1" / "train.log") in first


def test_seat_groups_get_the_micro_batches_of_their_k():
    ring = str(REPO / "configs" / "cpu" / "admm_ring.yaml")         # 4 seats
    assert pl.seat_overrides([1, 4, 8], ring, []) == ["micro_batches=2"]
    assert pl.seat_overrides([1, 8, 16], ring, []) == ["micro_batches=4"]
    assert pl.seat_overrides([1, 2, 4], ring, []) == []               # blocks of seats: nothing to split
    assert pl.seat_overrides([8], ring, ["micro_batches=4"]) == []    # the user's own
    assert pl.seat_overrides([1, 8], ring, ["n_agents=2"]) == ["micro_batches=4"]


def test_the_memory_table_compares_every_k_with_one_rank_per_seat():
    mib = 2 ** 20
    rows = [dict(model="m", k=k, shard=shard, backbone_bytes=[b * mib] * k, adapter_bytes=[mib] * k,
                 rss_before=[400 * mib] * k, rss_after=[(400 + b) * mib] * k, peak_rss=[(500 + b) * mib] * k)
            for k, shard, b in [(1, False, 100), (4, False, 100), (4, True, 26)]]
    for r in rows:
        r["param_ratio"] = max(r["backbone_bytes"]) / max(rows[0]["backbone_bytes"])
    text = pm.format_memory(rows)
    lines = text.splitlines()
    assert lines[2].split() == ["m", "1", "no", "100.0", "1.0", "1.000", "400.0", "500.0", "600.0", "200.0"]
    assert lines[4].split()[:5] == ["m", "4", "yes", "26.0", "1.0"]
    assert "m: backbone bytes per rank at k=4 sharded = 0.260 of k=1's (bound 0.30: holds)" in text
    rows[2]["param_ratio"] = 0.31
    assert "(bound 0.30: DOES NOT HOLD)" in pm.format_memory(rows)


@pytest.mark.slow
def test_the_memory_table_of_the_stand_in_at_one_and_two_ranks_per_seat(tmp_path, capsys):
    """Real seat groups of 1 and 2 gloo ranks load the shipped stand-in whole and sharded."""
    summary = tmp_path / "memory.json"
    rc = pl.main(["--no-rounds", "--memory", "standin", "--memory-ks", "1,2", "--out", str(tmp_path / "runs"),
                  "--json", str(summary), "--timeout", "240"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err      # the benchmark's error line and the failed rank's tail are on stderr
    rows = json.loads(summary.read_text())["memory"]
    assert [(r["k"], r["shard"]) for r in rows] == [(1, False), (2, False), (2, True)]
    one, two, sharded = rows
    assert two["backbone_bytes"] == one["backbone_bytes"] * 2 and two["param_ratio"] == 1.0
    assert 0.45 <= sharded["param_ratio"] <= 0.55 and sharded["adapter_bytes"] == two["adapter_bytes"]
    assert all(r["peak_rss"][i] >= r["rss_after"][i] > r["rss_before"][i] > 0 for r in rows for i in range(r["k"]))
    assert "standin: backbone bytes per rank at k=2 sharded = 0." in out and "holds" in out
