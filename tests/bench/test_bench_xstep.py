"""The x-step benchmark runs end to end and reports its fields (a smoke test, not a timing test).

``--quick`` shrinks the model, the data and the step counts; the overhead part still launches
3 gloo ranks, each with a real Trainer, for 1 warm-up + 2 rounds. TRL is not a dependency:
without it the TRL rows are skipped (null fields) and the run still exits 0. The rows take
their steps in rotation; the paired ratios are the medians of the per-rotation ratios.
"""
import json
import statistics
import sys

import pytest

from admm_dist.bench import xstep as bench
from admm_dist.bench.xstep_measure import sizes_for, trl_version

POSITIVE = ("ours_s", "ours_cpu_s", "ours_precompute_s", "overhead_share", "overhead_share_step_wall",
            "overhead_x_s_per_step", "wall_s")
TRL_FIELDS = bench.TRL_FIELDS


def _check_common(r):
    for key in POSITIVE:
        assert key in r, key
        assert isinstance(r[key], float) and r[key] > 0, (key, r[key])
    sz = r["sizes"]
    assert len(r["ours_step_times_s"]) == sz["steps"]
    assert all(t > 0 for t in r["ours_step_times_s"])
    assert r["overhead_share"] < 1 and r["overhead_share_step_wall"] < 1
    assert r["overhead_nprocs"] == 3 and r["overhead_comm"] == "ProcessGroupCommunicator"
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
        for key in ("trl", "trl_precompute"):
            ratios = [a / b for a, b in zip(r[f"{key}_step_times_s"], r["ours_step_times_s"])]
            assert r[f"{key}_paired_ratios"] == pytest.approx(ratios)
            assert r[f"{key}_over_ours_paired"] == pytest.approx(statistics.median(ratios))
            assert len(r[f"{key}_cpu_step_times_s"]) == r["sizes"]["steps"]
        assert r["method"] == "interleaved" and r["device"] == "cpu"
        assert "paired" in text
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


def test_bench_xstep_shapes_and_options(capsys):
    """--shape takes the table's dims; the real shapes get realistic lengths; bad options are one line."""
    sz = sizes_for("qwen3-8b")
    assert (sz.hidden, sz.layers, sz.heads, sz.kv_heads, sz.head_dim, sz.intermediate, sz.vocab, sz.tie) == (
        4096, 36, 32, 8, 128, 12288, 151936, False)
    assert (sz.batch, sz.prompt_tokens, sz.target_tokens) == (4, 512, 256)
    assert sizes_for("tiny") == bench.Sizes()
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", "--shape", "qwen3-8b"])
    assert e.value.code == 2
    assert "--quick is --shape micro" in capsys.readouterr().err
    assert bench.QUICK == sizes_for("micro") and bench.QUICK.hidden == 64
    with pytest.raises(SystemExit):
        bench.main(["--shape", "qwen3-9b"])


def test_bench_xstep_without_overhead(tmp_path):
    out = tmp_path / "xstep.json"
    assert bench.main(["--quick", "--no-trl", "--no-overhead", "--steps", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["overhead_share"] is None and r["overhead_skipped"] == "--no-overhead"
    assert r["ours_s"] > 0 and len(r["ours_step_times_s"]) == 2 and r["ours_peak_gib"] is None
