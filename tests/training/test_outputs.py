"""Outputs and checkpoints are never lost: each case a cluster user hit, on the real trainer
(single-process backend, tiny random Qwen3, real files), ends with one clear line and every
earlier result intact."""
import json
import os
import stat

import pytest
from safetensors import safe_open

from admm_dist.cli import train
from admm_dist.data.fitset import load_fitset, save_fitset
from admm_dist.training import checkpoint as ckpt

N = 3


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(N)


def _args(assets, tmp, **kw):
    d = dict(model_name=assets["backbone"], fitset_cache=assets["fit"], task="synthetic", n_agents=N,
             device="cpu", lora_rank=4, lora_alpha=8.0, lora_layers_last=2, k_outer=2, local_steps=2,
             batch_size=4, eta=0.02, rho=0.1, grad_clip=1.0, timeout_s=30, quiet=True,
             out=str(tmp / "runs" / "run"), report_dir=str(tmp / "reports"))
    d.update(kw)
    return [f"{k}={v}" for k, v in d.items()]


def _run(capsys, assets, tmp, **kw):
    rc = train.main(_args(assets, tmp, **kw))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return rc, err


def _bytes(path):
    with open(path, "rb") as fh:
        return fh.read()


def _snapshot(tmp):
    """Every file under tmp/runs and tmp/reports with its bytes."""
    out = {}
    for top in ("runs", "reports"):
        for dirpath, _, files in os.walk(tmp / top):
            for f in files:
                p = os.path.join(dirpath, f)
                out[p] = _bytes(p)
    return out


def test_a_fresh_run_never_mixes_with_the_run_already_in_out(assets, tmp_path, capsys):
    assert _run(capsys, assets, tmp_path)[0] == 0
    before = _snapshot(tmp_path)
    rc, err = _run(capsys, assets, tmp_path, rho=0.5)    # another run, same out, resume=never
    assert rc == 2 and len(err) == 1
    assert "already holds a run" in err[0] and "resume=auto" in err[0] and "overwrite=true" in err[0]
    assert _snapshot(tmp_path) == before                   # nothing touched
    # asked to: the old checkpoints go at once, the results when the new ones replace them
    rc, err = _run(capsys, assets, tmp_path, rho=0.5, overwrite="true")
    assert rc == 0, err
    fp = json.loads(_bytes(tmp_path / "runs" / "run.ckpt" / "round-000002" / "node-0.json"))["fingerprint"]
    old = json.loads(before[str(tmp_path / "runs" / "run.ckpt" / "round-000002" / "node-0.json")])["fingerprint"]
    assert fp != old
    assert _bytes(tmp_path / "runs" / "run-last.safetensors") != before[str(tmp_path / "runs" / "run-last.safetensors")]
    rc, err = _run(capsys, assets, tmp_path, overwrite="true", resume="auto")
    assert rc == 2 and "choose one" in err[0]


def test_resume_refuses_a_checkpoint_past_k_outer(assets, tmp_path, capsys):
    assert _run(capsys, assets, tmp_path, k_outer=3)[0] == 0
    before = _snapshot(tmp_path)
    rc, err = _run(capsys, assets, tmp_path, k_outer=2, resume="auto")
    assert rc == 2 and len(err) == 1 and "reach round 3, beyond k_outer=2" in err[0] and "k_outer=3" in err[0]
    assert _snapshot(tmp_path) == before


def test_the_fingerprint_follows_the_fit_sets_content_not_its_path(assets, tmp_path, capsys):
    path = str(tmp_path / "fit.jsonl")
    f = load_fitset(assets["fit"])
    save_fitset(path, f.examples, fit_mode=f.fit_mode, settings=f.settings, anchor_keys=f.anchor_keys)
    assert _run(capsys, assets, tmp_path, fitset_cache=path)[0] == 0
    # the same path, chosen and rejected swapped: resuming would train another objective
    import dataclasses
    swapped = [dataclasses.replace(e, target=e.rejected, rejected=e.target) for e in f.examples]
    save_fitset(path, swapped, fit_mode=f.fit_mode, settings=f.settings, anchor_keys=f.anchor_keys)
    before = _snapshot(tmp_path)
    rc, err = _run(capsys, assets, tmp_path, fitset_cache=path, k_outer=3, resume="auto")
    assert rc == 2 and len(err) == 1 and "written by another run" in err[0]
    assert _snapshot(tmp_path) == before
    # the original content at the same path resumes
    save_fitset(path, f.examples, fit_mode=f.fit_mode, settings=f.settings, anchor_keys=f.anchor_keys)
    assert _run(capsys, assets, tmp_path, fitset_cache=path, k_outer=3, resume="auto")[0] == 0


def test_refused_and_diverged_runs_keep_the_earlier_result_and_report(assets, tmp_path, capsys):
    assert _run(capsys, assets, tmp_path)[0] == 0
    last, report = tmp_path / "runs" / "run-last.safetensors", tmp_path / "reports" / "run-train.json"
    good = (_bytes(last), _bytes(report))
    rc, err = _run(capsys, assets, tmp_path, eta=1e8, grad_clip=1e8, overwrite="true")
    assert rc == 2 and len(err) == 1, err
    assert ("diverged" in err[0] and "max_delta_w_rel" in err[0]) or "non-finite" in err[0], err
    assert (_bytes(last), _bytes(report)) == good
    rc, err = _run(capsys, assets, tmp_path, eta=1e-13, k_outer=1, local_steps=1, overwrite="true")
    assert rc == 2 and "did not move" in err[0] and "earlier result in out= is kept" in err[0]
    assert (_bytes(last), _bytes(report)) == good
    assert os.path.exists(tmp_path / "reports" / "run-train-refused.json")


def test_out_names_a_run(assets, tmp_path, capsys):
    rc, err = _run(capsys, assets, tmp_path, out="")
    assert rc == 2 and len(err) == 1 and "name the run" in err[0]
    rc, err = _run(capsys, assets, tmp_path, out=str(tmp_path / "runs" / "slash") + "/")
    assert rc == 0, err
    assert os.path.isfile(tmp_path / "runs" / "slash-last.safetensors")
    assert not os.path.exists(tmp_path / "runs" / "slash" / "-last.safetensors")


def test_bad_output_paths_fail_before_any_work_in_one_line(assets, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for kw in (dict(report_dir=str(blocker / "reports")), dict(out=str(blocker / "run")),
               dict(out=str(blocker))):
        rc, err = _run(capsys, assets, tmp_path, **kw)
        assert rc == 2 and len(err) == 1, err
        assert "a_file" in err[0] and ("report_dir=" in err[0] or "out=" in err[0]), err
    assert not os.path.exists(tmp_path / "runs")           # nothing trained, nothing written
    # a read-only filesystem (root ignores permission bits, not a read-only mount)
    ro = next((line.split()[1] for line in open("/proc/mounts")
               if " ro," in f" {line.split()[3]}," and os.path.isdir(line.split()[1])), None)
    if ro is not None:
        rc, err = _run(capsys, assets, tmp_path, out=os.path.join(ro, "run"))
        assert rc == 2 and len(err) == 1 and "read-only" in err[0], err


def test_files_get_the_umask_s_mode(assets, tmp_path, capsys):
    old = os.umask(0o027)
    try:
        assert _run(capsys, assets, tmp_path)[0] == 0
    finally:
        os.umask(old)
    for p in (tmp_path / "runs" / "run-last.safetensors", tmp_path / "reports" / "run-train.json",
              tmp_path / "runs" / "run" / "node-0.safetensors",
              tmp_path / "runs" / "run.ckpt" / "round-000002" / "node-0.json"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o640, p


def test_the_adapter_carries_its_training_queries(assets, tmp_path, capsys):
    assert _run(capsys, assets, tmp_path)[0] == 0
    report = json.loads(_bytes(tmp_path / "reports" / "run-train.json"))
    with safe_open(str(tmp_path / "runs" / "run-last.safetensors"), framework="pt") as fh:
        meta = json.loads(fh.metadata()["meta"]) if "meta" in fh.metadata() else fh.metadata()
    keys = meta["anchor_keys"] if "anchor_keys" in meta else json.loads(meta["anchor_keys"])
    assert keys == report["anchor_keys"] and len(keys) > 0
    seat_map = json.loads(_bytes(tmp_path / "runs" / "run" / "seat_map.json"))
    assert seat_map["anchor_keys"] == report["anchor_keys"]


def test_examples_outside_the_chain_are_an_error(assets, tmp_path, capsys):
    import dataclasses
    f = load_fitset(assets["fit"])
    path = str(tmp_path / "bad.jsonl")
    save_fitset(path, f.examples + [dataclasses.replace(f.examples[0], seat=7)], fit_mode=f.fit_mode,
                settings=f.settings, anchor_keys=f.anchor_keys)
    rc, err = _run(capsys, assets, tmp_path, fitset_cache=path)
    assert rc == 2 and len(err) == 1 and "seat(s) [7]" in err[0] and "n_agents=3" in err[0]


def test_prune_keeps_other_runs_checkpoints():
    import tempfile

    import torch
    with tempfile.TemporaryDirectory() as root:
        for k in (1, 2, 3):
            ckpt.save_node(root, k, 0, {"x": torch.zeros(1)}, {"fingerprint": "other"})
        for k in (4, 5, 6):
            ckpt.save_node(root, k, 0, {"x": torch.zeros(1)}, {"fingerprint": "mine"})
        ckpt.prune(root, [0], 1, "mine")
        assert ckpt.completed_rounds(root, [0], "mine") == [6]
        assert ckpt.completed_rounds(root, [0], "other") == [1, 2, 3]


def test_the_tracking_settings_are_built_once(assets, tmp_path, monkeypatch):
    """``RunOutputs.tracking`` is built from the (frozen) config at its first use, then kept:
    the path checks, the tracking folder and the tracker's opening all read the same object."""
    from admm_dist.training.config import TrainConfig
    from admm_dist.training.outputs import RunOutputs

    cfg = TrainConfig(model_name=assets["backbone"], fitset_cache=assets["fit"], task="synthetic", n_agents=N,
                      report_to="tensorboard", out=str(tmp_path / "runs" / "run"),
                      report_dir=str(tmp_path / "reports"))
    built = []
    original = TrainConfig.tracking_config
    monkeypatch.setattr(TrainConfig, "tracking_config", lambda self: built.append(1) or original(self))
    outputs = RunOutputs(cfg, 0, lambda m: None)
    first = outputs.tracking
    assert outputs.problem() is None
    folder = outputs.tracking_folder()
    assert outputs.tracking is first and first.active == ["tensorboard"]
    assert folder == str(tmp_path / "reports" / "tracking" / "run")
    assert len(built) == 1
