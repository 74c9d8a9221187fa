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

from conftest import tiny_args

N = 3


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(N)


def _args(assets, tmp, **kw):
    return tiny_args(assets, **dict(dict(k_outer=2, timeout_s=30, quiet=True, out=str(tmp / "runs" / "run"),
                                         report_dir=str(tmp / "reports")), **kw))


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


def test_a_checkpoint_records_the_dtype_the_run_computed_in_not_the_word_auto(assets, tmp_path, capsys):
    """dtype=auto is float32 on CPU: a run written with auto resumes with dtype=float32, and a
    resume in bfloat16 (other numbers) is refused, naming dtype."""
    assert _run(capsys, assets, tmp_path, k_outer=2, dtype="auto")[0] == 0
    meta = json.loads(_bytes(tmp_path / "runs" / "run.ckpt" / "round-000002" / "node-0.json"))
    assert meta["identity"]["settings"]["dtype"] == "float32"
    rc, err = _run(capsys, assets, tmp_path, k_outer=3, resume="auto", dtype="bfloat16")
    assert rc == 2 and len(err) == 1 and "dtype" in err[0], err
    rc, err = _run(capsys, assets, tmp_path, k_outer=3, resume="auto", dtype="float32")
    assert rc == 0, err
    with open(tmp_path / "reports" / "run-train.json") as fh:
        assert json.load(fh)["resumed"]["after_round"] == 2


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


def _resumed_after(tmp):
    with open(tmp / "reports" / "run-train.json") as fh:
        return json.load(fh)["resumed"]["after_round"]


def test_a_moved_fit_set_resumes(assets, tmp_path, capsys):
    """The fit set at another path (moved, or named relative instead of absolute) with the same
    content resumes the run: the fingerprint holds its content, not its path."""
    import shutil

    first, moved = tmp_path / "a" / "fit.jsonl", tmp_path / "b" / "fit.jsonl"
    first.parent.mkdir()
    moved.parent.mkdir()
    shutil.copy(assets["fit"], first)
    assert _run(capsys, assets, tmp_path, fitset_cache=str(first))[0] == 0
    shutil.move(first, moved)
    rc, err = _run(capsys, assets, tmp_path, fitset_cache=str(moved), k_outer=3, resume="auto")
    assert rc == 0, err
    assert _resumed_after(tmp_path) == 2


def test_a_checkpoint_of_another_version_is_refused_in_one_line(assets, tmp_path, capsys):
    """A marker without what this version writes (here the run's identity) is refused, naming the
    file and the way back; nothing else is tried."""
    assert _run(capsys, assets, tmp_path)[0] == 0
    root = str(tmp_path / "runs" / "run.ckpt")
    k = ckpt.all_rounds(root)[-1]
    for node in range(N):
        path = os.path.join(ckpt.round_dir(root, k), f"node-{node}.json")
        with open(path) as fh:
            meta = json.load(fh)
        tensors, _ = ckpt.load_node(root, k, node, meta["fingerprint"])
        meta = {key: v for key, v in meta.items() if key not in ("round", "node", "tensors_sha256", "meta_sha256",
                                                                 "identity")}
        ckpt.save_node(root, k, node, tensors, meta)
    rc, err = _run(capsys, assets, tmp_path, k_outer=3, resume="auto")
    assert rc == 2 and len(err) == 1, err
    assert "lacks a valid 'identity'" in err[0] and "from another version" in err[0], err[0]


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


def test_the_refusal_rule_node_by_node():
    """Every node must move (but a node with no examples under local_only may stay at x^0), and
    none past max_delta_w_rel; the message names the nodes and the setting to change."""
    from admm_dist.training.config import TrainConfig
    from admm_dist.training.outputs import refusal

    cfg = TrainConfig(out="runs/r", max_delta_w_rel=10.0)
    assert refusal(cfg, [0.01, 0.02, 0.03], [4, 4, 4]) is None
    why = refusal(cfg, [0.01, 0.0, float("nan")], [4, 4, 4])
    assert "node(s) [1, 2] did not move" in why and "raise --eta or --k_outer" in why and "runs/r" in why
    why = refusal(cfg, [0.01, 12.5, 0.03], None)
    assert "diverged" in why and "node(s) [1] = 12.5 > max_delta_w_rel=10" in why and "lower --eta" in why
    assert "earlier result in out= is kept" in why
    local = TrainConfig(out="runs/r", local_only=True)
    assert refusal(local, [0.01, 0.0, 0.02], [4, 0, 4]) is None           # f_1 = 0: x_1 stays at x^0
    assert "node(s) [1] did not move" in refusal(cfg, [0.01, 0.0, 0.02], [4, 0, 4])   # coupled: it must move
    assert "no node had examples to train on" in refusal(local, [0.0], [0])


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
        ckpt.prune(root, [0], 1, "mine", upto=5)      # round 6 is not complete on every rank yet
        assert ckpt.completed_rounds(root, [0], "mine") == [5, 6]
        ckpt.prune(root, [0], 1, "mine", upto=6)
        assert ckpt.completed_rounds(root, [0], "mine") == [6]
        assert ckpt.completed_rounds(root, [0], "other") == [1, 2, 3]
        assert sorted(os.listdir(root)) == [f"round-00000{k}" for k in (1, 2, 3, 6)]


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


# ---------------------------------------------------------------- issue 21: nothing lost, round 3
def test_a_second_run_into_a_locked_out_is_refused_and_a_stale_lock_is_taken_over(assets, tmp_path, capsys):
    import subprocess
    import sys
    import textwrap

    out = str(tmp_path / "runs" / "run")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from admm_dist.core.lock import OutputLock
        OutputLock([({out!r}, "out={out}", "another out=")]).acquire()
        print("locked", flush=True)
        sys.stdin.read()          # held until the test closes our stdin
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc, err = _run(capsys, assets, tmp_path)
        assert rc == 2 and len(err) == 1, err
        assert f"out={out} is in use by a running job (pid {holder.pid} on host" in err[0], err[0]
        assert "wait for it to finish, or choose another out=" in err[0]
        assert not os.path.exists(out + "-last.safetensors") and not os.path.exists(out + ".ckpt")
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # the holder is gone but its lock file (a kill -9 leaves one) names a dead PID on this host
    with open(out + ".lock", "w") as fh:
        json.dump({"pid": holder.pid, "host": os.uname().nodename, "start": "1", "since": 0}, fh)
    rc, err = _run(capsys, assets, tmp_path)
    assert rc == 0, err
    assert not os.path.exists(out + ".lock")             # released at the end


def test_reports_of_runs_named_alike_never_collide(assets, tmp_path, capsys):
    a, b = str(tmp_path / "runs" / "a" / "ring"), str(tmp_path / "runs" / "b" / "ring")
    assert _run(capsys, assets, tmp_path, out=a)[0] == 0
    before = _snapshot(tmp_path)
    rc, err = _run(capsys, assets, tmp_path, out=b)
    assert rc == 2 and len(err) == 1, err
    assert "holds the report of another run named alike" in err[0] and f"out={a}" in err[0], err[0]
    assert "report_dir=" in err[0]
    assert _snapshot(tmp_path) == before
    assert _run(capsys, assets, tmp_path, out=b, report_dir=str(tmp_path / "reports_b"))[0] == 0


def test_overwrite_removes_every_output_of_the_old_run(assets, tmp_path, capsys):
    out = tmp_path / "runs" / "run"
    assert _run(capsys, assets, tmp_path, dev_frac=0.25, export_peft="true")[0] == 0
    assert os.path.isfile(f"{out}-best.safetensors") and os.path.isdir(f"{out}-last-peft")
    assert _run(capsys, assets, tmp_path, overwrite="true", rho=0.2)[0] == 0
    assert not os.path.exists(f"{out}-best.safetensors") and not os.path.exists(f"{out}-last-peft")
    report = json.loads(_bytes(tmp_path / "reports" / "run-train.json"))
    assert report["config"]["rho"] == 0.2 and "best" not in report
    leftovers = [f for d in (tmp_path / "runs", out) for f in os.listdir(d) if f.startswith(".")]
    assert leftovers == []                                 # no temporaries, no staged files


def test_overwrite_checks_everything_before_it_removes_anything(assets, tmp_path, capsys):
    assert _run(capsys, assets, tmp_path, k_outer=3)[0] == 0
    before = _snapshot(tmp_path)
    rc, err = _run(capsys, assets, tmp_path, overwrite="true", model_name=str(tmp_path / "no-such-model"))
    assert rc == 2 and len(err) == 1, err
    assert _snapshot(tmp_path) == before                   # the old run is intact


def _flip(path, offset_from_end, bit):
    with open(path, "r+b") as fh:
        fh.seek(-offset_from_end, os.SEEK_END)
        byte = fh.read(1)[0]
        fh.seek(-offset_from_end, os.SEEK_END)
        fh.write(bytes([byte ^ (1 << bit)]))


def test_a_damaged_checkpoint_is_refused_naming_the_file(assets, tmp_path, capsys):
    assert _run(capsys, assets, tmp_path, k_outer=2)[0] == 0
    folder = tmp_path / "runs" / "run.ckpt" / "round-000002"
    tensors, marker = folder / "node-1.safetensors", folder / "node-1.json"
    good = _bytes(tensors), _bytes(marker)
    _flip(tensors, 5, 0)                                   # one mantissa bit of the last tensor
    rc, err = _run(capsys, assets, tmp_path, k_outer=3, resume="auto")
    assert rc == 2 and len(err) == 1 and f"{tensors} fails its checksum" in err[0], err
    assert "delete that round folder" in err[0]
    tensors.write_bytes(good[0])
    meta = json.loads(good[1])
    meta["engine"]["rho"] = 0.3                            # an edit that still parses
    marker.write_text(json.dumps(meta))
    rc, err = _run(capsys, assets, tmp_path, k_outer=3, resume="auto")
    assert rc == 2 and len(err) == 1 and f"{marker} fails its checksum" in err[0], err
    del meta["engine"]["rho"]                              # a layout from elsewhere, checksum made to fit
    meta["meta_sha256"] = ckpt._meta_digest(meta)
    marker.write_text(json.dumps(meta))
    rc, err = _run(capsys, assets, tmp_path, k_outer=3, resume="auto")
    assert rc == 2 and len(err) == 1 and "lacks a valid 'rho'" in err[0], err
    marker.write_bytes(good[1])
    assert _run(capsys, assets, tmp_path, k_outer=3, resume="auto")[0] == 0


def test_eta_and_grad_clip_may_change_on_resume_as_the_non_finite_error_advises(assets, tmp_path, capsys):
    import faults
    with faults.armed("nan@3:0"):
        rc, err = _run(capsys, assets, tmp_path, k_outer=4)
    assert rc == 1 and len(err) == 1 and "round 3: non-finite" in err[0], err
    assert "resume=auto and a lower eta= or grad_clip=" in err[0]
    rc, err = _run(capsys, assets, tmp_path, k_outer=4, resume="auto", eta=0.01, grad_clip=0.5)
    assert rc == 0, err
    report = json.loads(_bytes(tmp_path / "reports" / "run-train.json"))
    assert report["resumed"] == {"after_round": 2, "changed": {"eta": [0.02, 0.01], "grad_clip": [1.0, 0.5]}}
    assert len(report["rounds"]) == 4


def test_temporaries_of_a_killed_write_are_removed(assets, tmp_path, capsys):
    assert _run(capsys, assets, tmp_path, k_outer=2, keep_checkpoints=1)[0] == 0
    root = tmp_path / "runs" / "run.ckpt"
    orphan = root / "round-000002" / ".node-0.json.x1y2.tmp"
    orphan.write_text("half a file")
    assert _run(capsys, assets, tmp_path, k_outer=3, keep_checkpoints=1, resume="auto")[0] == 0
    assert sorted(os.listdir(root)) == ["round-000003"]    # round 2 pruned, its folder gone


def test_results_move_together_or_not_at_all(assets, tmp_path, capsys):
    """A report that cannot be written (here a folder in its way; a full report_dir alike) leaves
    -last, the node files and the report as they were: all are staged before any is replaced."""
    assert _run(capsys, assets, tmp_path, k_outer=2)[0] == 0
    report = tmp_path / "reports" / "run-train.json"
    kept = json.loads(_bytes(report))
    report.unlink()
    report.mkdir()
    before = _snapshot(tmp_path)
    rc, err = _run(capsys, assets, tmp_path, k_outer=3, resume="auto")
    assert rc == 2 and len(err) == 1 and f"cannot use {report}" in err[0], err
    after = _snapshot(tmp_path)
    assert {p: b for p, b in after.items() if ".ckpt" not in p} == \
        {p: b for p, b in before.items() if ".ckpt" not in p}       # only the new checkpoint came
    report.rmdir()
    report.write_text(json.dumps(kept))
    assert _run(capsys, assets, tmp_path, k_outer=3, resume="auto")[0] == 0
    with safe_open(str(tmp_path / "runs" / "run" / "node-0.safetensors"), framework="pt") as fh:
        assert fh.metadata()["round"] == "3"
    assert json.loads(_bytes(tmp_path / "reports" / "run-train.json"))["rounds"][-1]["round"] == 3


def test_a_checkpoint_that_lacks_a_node_is_refused_naming_it(assets, tmp_path, capsys):
    assert _run(capsys, assets, tmp_path, k_outer=3)[0] == 0
    root = tmp_path / "runs" / "run.ckpt"
    for ext in ("json", "safetensors"):          # round 3 without node 2: a write killed there
        (root / "round-000003" / f"node-2.{ext}").unlink()
    before = _snapshot(tmp_path)
    for k in (1, 2):                             # and node 2 lost from the rounds before
        for ext in ("json", "safetensors"):
            (root / f"round-00000{k}" / f"node-2.{ext}").unlink()
    rc, err = _run(capsys, assets, tmp_path, k_outer=4, resume="auto")
    assert rc == 2 and len(err) == 1 and "lack node(s) [2]" in err[0] and "round 2" in err[0], err
    for path, data in before.items():            # restored: the round every node holds is round 2
        if not os.path.exists(path):
            with open(path, "wb") as fh:
                fh.write(data)
    assert _run(capsys, assets, tmp_path, k_outer=4, resume="auto")[0] == 0
    report = json.loads(_bytes(tmp_path / "reports" / "run-train.json"))
    assert report["resumed"]["after_round"] == 2


# ---------------------------------------------------------------- issue 40: nothing lost, round 4
def _holding(lock_code: str):
    """A process that takes a lock by ``lock_code`` (product code) and holds it until its stdin closes."""
    import subprocess
    import sys

    code = f"import sys\n{lock_code}\nprint('locked', flush=True)\nsys.stdin.read()\n"
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def _release(holder):
    holder.stdin.close()
    holder.wait(timeout=30)


def test_a_planted_lock_link_is_refused_and_its_target_kept(assets, tmp_path, capsys):
    precious = tmp_path / "precious.txt"
    precious.write_text("precious\n")
    (tmp_path / "runs").mkdir()
    os.symlink(precious, tmp_path / "runs" / "run.lock")
    rc, err = _run(capsys, assets, tmp_path, dry_run="true")
    assert rc == 2 and len(err) == 1, err
    assert "run.lock is a symbolic link, not a lock file" in err[0]
    assert precious.read_text() == "precious\n"


def test_a_linked_out_is_the_folder_it_names(assets, tmp_path, capsys):
    real, link = tmp_path / "runs" / "real", tmp_path / "runs" / "link"
    real.mkdir(parents=True)
    os.symlink(real, link)
    holder = _live_run_locks(assets, tmp_path, out=str(real))
    try:       # a live run in real/: the same folder by another name is refused, untouched
        rc, err = _run(capsys, assets, tmp_path, out=str(link), rho=0.2)
        assert rc == 2 and len(err) == 1 and f"out={real} is in use by a running job (pid {holder.pid}" in err[0]
        assert os.listdir(real) == []
    finally:
        _release(holder)
    assert _run(capsys, assets, tmp_path, out=str(link))[0] == 0
    with open(tmp_path / "reports" / "real-train.json") as fh:
        assert json.load(fh)["out_path"] == str(real)          # the real path in every record
    assert os.path.isfile(str(real) + "-last.safetensors") and os.path.isdir(str(real) + ".ckpt")
    rc, err = _run(capsys, assets, tmp_path, out=str(real), rho=0.2)   # and the run is found by either name
    assert rc == 2 and "already holds a run" in err[0]


def _live_run_locks(assets, tmp, **kw):
    """A process holding the locks a live run with these settings holds (RunOutputs.make_lock)."""
    from conftest import tiny_settings

    live = dict(tiny_settings(assets), report_dir=str(tmp / "reports"), **kw)
    return _holding(f"from admm_dist.training.config import TrainConfig\n"
                    f"from admm_dist.training.outputs import RunOutputs\n"
                    f"RunOutputs(TrainConfig(**{live!r}), 0, print).make_lock().acquire()")


def test_an_out_aimed_at_a_live_runs_report_is_refused(assets, tmp_path, capsys):
    holder = _live_run_locks(assets, tmp_path, out=str(tmp_path / "runs" / "a"))
    try:
        report = os.path.join(str(tmp_path / "reports"), "a-train.json")
        rc, err = _run(capsys, assets, tmp_path, out=report)
        assert rc == 2 and len(err) == 1 and f"is in use by a running job (pid {holder.pid}" in err[0], err
        assert not os.path.exists(report)                       # the live run's report path stays free
    finally:
        _release(holder)


def _z_of(path):
    from safetensors.torch import load_file
    return load_file(path)


def test_a_checkpoint_pair_from_another_round_is_not_trained_on(assets, tmp_path, capsys):
    import shutil

    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    assert _run(capsys, assets, tmp_path, out=str(a), k_outer=3, local_steps=2)[0] == 0
    shutil.copytree(str(a) + ".ckpt", str(b) + ".ckpt")          # b: the same checkpoints, untouched
    r2, r3 = ckpt.round_dir(str(a) + ".ckpt", 2), ckpt.round_dir(str(a) + ".ckpt", 3)
    for ext in (".json", ".safetensors"):                          # a: node 1 of round 3 is round 2's pair
        shutil.copyfile(os.path.join(r2, f"node-1{ext}"), os.path.join(r3, f"node-1{ext}"))
    assert ckpt.completed_rounds(str(a) + ".ckpt", [0, 1, 2]) == [1, 2]
    with pytest.raises(ckpt.CheckpointError, match="names round 2, node 1, not round 3, node 1"):
        ckpt.load_node(str(a) + ".ckpt", 3, 1, json.load(open(os.path.join(r3, "node-0.json")))["fingerprint"])
    for out in (a, b):
        rc, err = _run(capsys, assets, tmp_path, out=str(out), k_outer=4, local_steps=2, resume="auto",
                       quiet="false")
        assert rc == 0, err
    ta, tb = _z_of(str(a) + "-last.safetensors"), _z_of(str(b) + "-last.safetensors")
    assert ta.keys() == tb.keys() and all((ta[k] == tb[k]).all() for k in ta)   # fell back a round: the same bits


def test_final_node_files_and_the_seat_map_must_name_their_place(assets, tmp_path, capsys):
    import shutil

    import torch

    from admm_dist.core.errors import UserError
    from admm_dist.mas.evaluation import from_state
    from admm_dist.model.adapter import BOnlyLoRA
    from admm_dist.model.loading import load_model

    out = tmp_path / "runs" / "run"
    assert _run(capsys, assets, tmp_path)[0] == 0
    seats = lambda cfg: list(range(N))    # noqa: E731
    from_state(str(out), "consensus", N, seats)                    # the run's own files load
    shutil.copyfile(out / "node-0.safetensors", out / "node-1.safetensors")
    deploy = from_state(str(out), "local", N, seats)
    model, _ = load_model(assets["backbone"], torch.device("cpu"))
    adapter = BOnlyLoRA(model, deploy.adapter_config)
    with pytest.raises(UserError, match="holds node 0's state, not node 1's: it was copied from another file"):
        deploy.vectors(adapter)


def test_a_refused_resume_names_the_setting_that_differs(assets, tmp_path, capsys):
    assert _run(capsys, assets, tmp_path, rho=0.1)[0] == 0
    rc, err = _run(capsys, assets, tmp_path, rho=0.2, k_outer=3, resume="auto")
    assert rc == 2 and len(err) == 1, err
    assert "were written by another run" in err[0] and "it differs in rho 0.1 there, 0.2 here" in err[0], err[0]


def test_no_result_file_is_written_through_a_planted_link(assets, tmp_path, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("precious\n")
    (precious / "sub").mkdir()
    (precious / "sub" / "keep.txt").write_text("precious\n")
    out = tmp_path / "runs" / "run"
    out.mkdir(parents=True)
    (tmp_path / "reports").mkdir()
    plants = {out / "node-0.safetensors": precious / "keep.txt", out / "config.yaml": precious / "keep.txt",
              tmp_path / "runs" / "run-last.safetensors": precious / "keep.txt",
              tmp_path / "runs" / ".run-last.safetensors.staged": precious / "keep.txt",
              tmp_path / "runs" / "run-last-peft": precious / "sub",
              tmp_path / "reports" / "run-train.json": precious / "keep.txt"}
    for link, target in plants.items():
        os.symlink(target, link)
    rc, err = _run(capsys, assets, tmp_path, export_peft="true", overwrite="true")
    assert rc == 0, err
    assert (precious / "keep.txt").read_text() == "precious\n" and (precious / "sub" / "keep.txt").exists()
    assert sorted(os.listdir(precious)) == ["keep.txt", "sub"] and os.listdir(precious / "sub") == ["keep.txt"]
    for link in plants:                        # each name now holds the run's own file, not a link
        assert not os.path.islink(link) or not os.path.lexists(link), link
    assert os.path.isdir(tmp_path / "runs" / "run-last-peft") and os.path.isfile(out / "config.yaml")


def test_a_planted_link_for_a_checkpoint_round_folder_is_refused(assets, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "runs" / "run.ckpt"
    root.mkdir(parents=True)
    os.symlink(elsewhere, root / "round-000001")
    rc, err = _run(capsys, assets, tmp_path, resume="auto")
    assert rc == 2 and len(err) == 1 and "round-000001 is a symbolic link" in err[0], err
    assert os.listdir(elsewhere) == []
