"""The x-step benchmark runs end to end and reports its fields (a smoke test, not a timing test).

``--quick`` shrinks the model, the data and the step counts; the overhead part still launches
3 gloo ranks, each with a real Trainer, for 1 warm-up + 2 rounds. TRL is not a dependency:
without it the TRL rows are skipped (null fields) and the run still exits 0.
"""
import json
import sys

import pytest

from admm_dist.bench import xstep as bench
from admm_dist.bench.xstep_measure import trl_version

POSITIVE = ("ours_s", "ours_precompute_s", "overhead_share", "overhead_share_step_wall",
            "overhead_x_s_per_step", "wall_s")
TRL_FIELDS = ("trl_s", "trl_precompute_s", "trl_over_ours", "trl_precompute_over_ours",
              "trl_precompute_ref_s", "trl_inner_s", "trl_precompute_inner_s")


def _check_common(r):
    for key in POSITIVE:
        assert key in r, key
        assert isinstance(r[key], float) and r[key] > 0, (key, r[key])
    sz = r["sizes"]
    assert len(r["ours_step_times_s"]) == sz["steps"]
    assert all(t > 0 for t in r["ours_step_times_s"])
    assert r["overhead_share"] < 1 and r["overhead_share_step_wall"] < 1
    assert r["overhead_nprocs"] == 3 and r["overhead_comm"] == "RingCommunicator"
    assert len(r["overhead_rounds"]) == sz["rounds"]
    for rd in r["overhead_rounds"]:
        assert len(rd["sec_x"]) == 3 and rd["x_s"] > 0 and rd["wall_s"] >= rd["x_s"]
    assert r["threads"] == 1 and r["overhead_threads_per_rank"] == 1
    assert r["numel_b"] > 0
    for key in TRL_FIELDS:
        assert key in r, key


def test_bench_xstep_quick(tmp_path, capsys):
    out = tmp_path / "xstep.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    _check_common(r)
    text = capsys.readouterr().out
    assert "ours_s" in text and "overhead_share" in text
    if trl_version() is None:
        assert r["trl"] is None and all(r[k] is None for k in TRL_FIELDS)
        assert "TRL rows skipped" in text
    else:
        for key in TRL_FIELDS:
            assert isinstance(r[key], float) and r[key] > 0, (key, r[key])
        assert r["trl_over_ours"] == pytest.approx(r["trl_s"] / r["ours_s"])
        assert r["trl_lora_a_frozen"] == r["trl_precompute_lora_a_frozen"] > 0
        # TRL trains exactly the B entries our adapter trains
        assert r["trl_trainable_params"] == r["numel_b"]
        sz = r["sizes"]
        assert r["trl_token_lengths"] == [sz["prompt_tokens"], sz["target_tokens"],
                                          sz["target_tokens"]]


def test_bench_xstep_without_trl(tmp_path, capsys, monkeypatch):
    """With trl not importable the TRL rows are skipped with one line and the run exits 0."""
    monkeypatch.setitem(sys.modules, "trl", None)  # makes `import trl` raise ImportError
    out = tmp_path / "xstep.json"
    assert bench.main(["--quick", "--steps", "2", "--rounds", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    _check_common(r)
    assert r["trl"] is None and r["trl_skipped"] == "trl not importable"
    assert all(r[k] is None for k in TRL_FIELDS)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "trl is not importable" in ln]
    assert len(lines) == 1
