"""Experiment tracking on a tiny run: TensorBoard's event files (read back with TensorBoard's
own reader) and W&B's offline run file (read back with W&B's own record schema) hold every
round's figures, equal to the JSON report's; rank 0 writes under torchrun; bad settings and
another run's events are refused with the fix named."""
import glob
import json
import os
import struct

import pytest

from admm_dist.core.errors import UserError
from admm_dist.bench.launcher import launch_cpu
from admm_dist.demo.synthetic import write_fitset
from admm_dist.demo.tiny import save_tiny_backbone
from admm_dist.training.config import TrainConfig
from admm_dist.training.tracking import TrackingConfig, collection_scalars, event_files, open_tracker
from admm_dist.training.trainer import Trainer

from conftest import train_local

N = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("assets")
    bb = save_tiny_backbone(str(d / "backbone"), seed=1, hidden=32, layers=2, heads=2)
    settings = {"task": "synthetic", "n_agents": N, "adapt_roles": "all"}
    fit = write_fitset(str(d / "dpo.jsonl"), settings=settings, per_seat=16,
                       tokenizer=AutoTokenizer.from_pretrained(bb))
    return {"backbone": bb, "fit": fit}


def _cfg(assets, tmp_path, **kw):
    base = dict(model_name=assets["backbone"], fitset_cache=assets["fit"], task="synthetic", n_agents=N,
                device="cpu", lora_rank=4, lora_alpha=8.0, lora_layers_last=2, k_outer=3, local_steps=2,
                batch_size=4, eta=0.02, rho=0.1, grad_clip=1.0, dev_frac=0.25, out=str(tmp_path / "run"),
                report_dir=str(tmp_path / "reports"), quiet=True, timeout_s=60)
    base.update(kw)
    return TrainConfig(**base)


def read_tensorboard(folder):
    """{tag: [(step, value)]} from every event file in ``folder``, by TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}, acc


def read_wandb_offline(path):
    """The history rows of an offline ``run-*.wandb`` file: W&B's record log (a LevelDB-style
    log of 32 KiB blocks after a 7-byte header), each record W&B's own protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    rows, config, pos, pending = [], {}, 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if kind == 0:        # the rest of the block is padding
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):   # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            which = rec.WhichOneof("record_type")
            if which == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
            elif which in ("run", "config"):   # the run's config, and any later update of it
                updates = rec.run.config.update if which == "run" else rec.config.update
                config.update({u.key: json.loads(u.value_json) for u in updates})
    return rows, config


def _per_node(report, key):
    return [r[key] for r in report["rounds"]]


def test_tensorboard_holds_every_rounds_figures_equal_to_the_report(assets, tmp_path):
    report = train_local(_cfg(assets, tmp_path, report_to="tensorboard"))
    folder = tmp_path / "reports" / "tracking" / "run"
    assert len(event_files(str(folder))) == 1
    scalars, acc = read_tensorboard(str(folder))
    rounds = [r["round"] for r in report["rounds"]]
    assert rounds == [1, 2, 3]
    for tag, key in (("primal_residual_normalized", "primal_normalized"), ("primal_residual", "primal"),
                     ("dual_residual", "dual"), ("loss", "f"), ("bytes_sent/consensus", "bytes_sent"),
                     ("bytes_recv/consensus", "bytes_recv"), ("seconds/x_step", "sec_x")):
        for i in range(N):
            got = scalars[f"{tag}/node_{i}"]
            assert [s for s, _ in got] == rounds
            assert [v for _, v in got] == pytest.approx([row[i] for row in _per_node(report, key)], rel=1e-6)
    assert [v for _, v in scalars["admm/rho"]] == pytest.approx([r["rho"] for r in report["rounds"]])
    assert [(p["round"], p["dev_nll"]) for p in report["dev_curve"]] == \
        [(s, pytest.approx(v, rel=1e-6)) for s, v in scalars["dev/nll"]]
    assert all(v > 0 for _, v in scalars["bytes_sent/telemetry"])
    assert scalars["final/delta_w_rel"] == [(3, pytest.approx(report["delta_w_rel"], rel=1e-6))]
    assert scalars["admm/delta_w_rel"][-1][1] == pytest.approx(report["delta_w_rel"], rel=1e-6)
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "report_to: tensorboard" in config_text and "k_outer: 3" in config_text


def test_a_resumed_run_has_one_value_per_round(assets, tmp_path):
    """An interrupted run's second attempt purges the events past the round it resumes after."""
    first = _cfg(assets, tmp_path, report_to="tensorboard", k_outer=2)
    train_local(first)
    report = train_local(_cfg(assets, tmp_path, report_to="tensorboard", k_outer=3, resume="auto"))
    scalars, _ = read_tensorboard(str(tmp_path / "reports" / "tracking" / "run"))
    got = scalars["primal_residual_normalized/node_0"]
    assert [s for s, _ in got] == [1, 2, 3]
    assert [v for _, v in got] == pytest.approx([r["primal_normalized"][0] for r in report["rounds"]], rel=1e-6)


def test_wandb_offline_run_holds_every_rounds_figures(assets, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    report = train_local(_cfg(assets, tmp_path, report_to="tensorboard,wandb",
                              tracking_dir=str(tmp_path / "track")))
    runs = glob.glob(str(tmp_path / "track" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, "W&B must run offline by default (an offline-run-* folder)"
    rows, config = read_wandb_offline(runs[0])
    by_step = {r["_step"]: r for r in rows if "primal_residual_normalized/node_0" in r}
    assert sorted(by_step) == [1, 2, 3]
    for r in report["rounds"]:
        row = by_step[r["round"]]
        for i in range(N):
            assert row[f"primal_residual_normalized/node_{i}"] == pytest.approx(r["primal_normalized"][i], rel=1e-9)
            assert row[f"bytes_sent/consensus/node_{i}"] == r["bytes_sent"][i]
    assert config["k_outer"] == 3 and config["report_to"] == "tensorboard,wandb"
    assert event_files(str(tmp_path / "track"))   # both trackers at once


def test_collection_statistics_are_numeric_and_named():
    stats = {"queries": 8, "kept_queries": 6, "examples": 48, "mean_pass_rate": 0.5, "credit": "shared",
             "collection": 1, "prescreen": {"pool": 16, "kept": 8}, "per_group_outcomes": {"a": [1]}}
    assert collection_scalars(stats) == {
        "collection/queries": 8.0, "collection/kept_queries": 6.0, "collection/examples": 48.0,
        "collection/mean_pass_rate": 0.5, "collection/prescreen_pool": 16.0, "collection/prescreen_kept": 8.0}


def _rank_worker(ctx, cfg):
    return Trainer(cfg, ctx).train()["rounds"]


@pytest.mark.slow
def test_under_torchrun_rank_0_alone_writes_every_nodes_figures(assets, tmp_path):
    cfg = _cfg(assets, tmp_path, report_to="tensorboard", k_outer=2)
    rounds = launch_cpu(_rank_worker, N, cfg, timeout_s=120)[0]
    folder = str(tmp_path / "reports" / "tracking" / "run")
    assert len(event_files(folder)) == 1          # one writer: rank 0
    scalars, _ = read_tensorboard(folder)
    for i in range(N):
        assert [v for _, v in scalars[f"primal_residual_normalized/node_{i}"]] == \
            pytest.approx([r["primal_normalized"][i] for r in rounds], rel=1e-6)


def test_another_runs_events_are_refused_unless_overwrite(assets, tmp_path):
    train_local(_cfg(assets, tmp_path, report_to="tensorboard", k_outer=1, out=str(tmp_path / "a")))
    folder = str(tmp_path / "reports" / "tracking" / "a")
    # a new run (its own out=) that names the same tracking folder
    with pytest.raises(UserError, match="holds another run's TensorBoard events: replace them with overwrite"):
        train_local(_cfg(assets, tmp_path, report_to="tensorboard", k_outer=1, out=str(tmp_path / "b"),
                         tracking_dir=folder))
    old = event_files(folder)
    train_local(_cfg(assets, tmp_path, report_to="tensorboard", k_outer=1, out=str(tmp_path / "b"),
                     tracking_dir=folder, overwrite=True))
    new = event_files(folder)
    assert len(new) == 1 and new != old


@pytest.mark.parametrize("kw, match", [
    (dict(report_to="tensorbord"), "report_to='tensorbord': choose from none, tensorboard, wandb"),
    (dict(report_to="none,wandb"), "'none' cannot be combined"),
    (dict(report_to="wandb", wandb_mode="cloud"), "wandb_mode='cloud': choose one of offline, online"),
])
def test_bad_tracking_settings_name_the_fix(kw, match):
    with pytest.raises(UserError, match=match):
        TrackingConfig(**kw)


def test_the_tracking_keys_do_not_change_the_checkpoint_fingerprint(assets, tmp_path):
    a = _cfg(assets, tmp_path)
    b = _cfg(assets, tmp_path, report_to="tensorboard,wandb", tracking_dir=str(tmp_path / "x"))
    assert a.fingerprint() == b.fingerprint()
    assert os.path.basename(b.out) == "run"


def test_a_tracker_that_is_not_installed_is_refused_before_any_work(assets, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)     # `import wandb` now fails, as if not installed
    with pytest.raises(UserError, match=r"report_to=wandb needs wandb, which is not installed: "
                                        r"pip install 'admm_dist\[wandb\]'"):
        train_local(_cfg(assets, tmp_path, report_to="wandb"))
    assert not (tmp_path / "reports").exists() and not (tmp_path / "run").exists()


def test_the_last_rounds_delta_w_rel_is_computed_once(assets, tmp_path, monkeypatch):
    """With a tracker on, the last round's delta_w_rel of z_0 (logged by the round) is the
    result's: measured once, the same figure in the round's scalars, the final ones and the report."""
    import admm_dist.training.trainer as trainer_module

    calls = []
    original = trainer_module.delta_w_rel

    def counted(adapter, vec, *args):
        calls.append(1)
        return original(adapter, vec, *args)

    monkeypatch.setattr(trainer_module, "delta_w_rel", counted)
    report = train_local(_cfg(assets, tmp_path, report_to="tensorboard"))
    # one per round for the tracker (z_0), then one per other node at the end (z_1, z_2)
    assert len(calls) == 3 + (N - 1), len(calls)
    scalars, _ = read_tensorboard(str(tmp_path / "reports" / "tracking" / "run"))
    assert scalars["final/delta_w_rel"][0][1] == scalars["admm/delta_w_rel"][-1][1]   # the same float32
    assert scalars["final/delta_w_rel"] == [(3, pytest.approx(report["delta_w_rel"], rel=1e-6))]

    calls.clear()   # without a tracker: one per node, at the end
    train_local(_cfg(assets, tmp_path / "plain"))
    assert len(calls) == N


# ----------------------------------------------------------------------------- attempts and failures
def _attempt(folder, resumed_after, steps, value, recollect_every=2):
    """One attempt of a run as the trainer logs it: its collections (a fresh start logs collection
    0 at step 0), then each round's figures, plus each later collection at its round."""
    tracker = open_tracker(TrackingConfig(report_to="tensorboard"), rank=0, folder=folder, name="run",
                           config={}, config_yaml="k_outer: 6", run_id="run-x", resumed_after=resumed_after)
    try:
        if not resumed_after:
            tracker.log(0, {"collection/examples": value})
        for step in steps:
            tracker.log(step, {"loss/node_0": value + step, "primal_residual/node_0": value - step})
            if step % recollect_every == 0:
                tracker.log(step, {"collection/examples": value + step})
    finally:
        tracker.close()


@pytest.mark.parametrize("resumed_after", [0, 3])
def test_a_second_attempt_leaves_one_value_per_step(tmp_path, resumed_after):
    """The first attempt logged rounds 1-5 and was killed (its last checkpoint: round 3, or none:
    resume=auto then starts from round 0). The second logs again from there: TensorBoard's reader
    holds one value per step, the second attempt's wherever it logged one, and one config."""
    folder = str(tmp_path / "tracking")
    _attempt(folder, 0, range(1, 6), 100.0)
    _attempt(folder, resumed_after, range(resumed_after + 1, 7), 200.0)
    assert len(event_files(folder)) == (2 if resumed_after else 1)   # from round 0: the first one's are removed
    scalars, acc = read_tensorboard(folder)
    for tag, sign in (("loss/node_0", 1), ("primal_residual/node_0", -1)):
        assert scalars[tag] == [(s, (100.0 if s <= resumed_after else 200.0) + sign * s) for s in range(1, 7)]
    first = 100.0 if resumed_after else 200.0    # collections 0 and 1 ran before round 3's checkpoint
    assert scalars["collection/examples"] == [(0, first), (2, first + 2), (4, 204.0), (6, 206.0)]
    assert [t.step for t in acc.Tensors("config/text_summary")] == [0]


def test_a_resumed_attempts_file_is_read_after_the_earlier_ones(tmp_path):
    """Readers load a folder's event files in name order: a second attempt started within the
    same second as the first, whose file name would sort after its own (another host, a larger
    pid), still comes after it, so the purge drops the first attempt's rounds past 1."""
    import time

    folder = tmp_path / "tracking"
    _attempt(str(folder), 0, range(1, 4), 100.0)
    [first] = event_files(str(folder))
    later = folder / f"events.out.tfevents.{int(time.time()):010d}.zzz.99999999.7"
    os.rename(first, later)
    _attempt(str(folder), 1, range(2, 4), 200.0)
    assert event_files(str(folder))[0] == str(later)
    scalars, _ = read_tensorboard(str(folder))
    assert scalars["loss/node_0"] == [(1, 101.0), (2, 202.0), (3, 203.0)]


# A child whose files may not grow past 16 KiB: the event file's writes then fail with EFBIG
# (SIGXFSZ ignored), a real error from the kernel, as a full disk gives ENOSPC.
FULL_TRACKING_DIR = r"""
import resource, signal, sys
from admm_dist.core.errors import UserError
from admm_dist.training.tracking import TrackingConfig, open_tracker
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
tracker = open_tracker(TrackingConfig(report_to="tensorboard"), rank=0, folder=sys.argv[1], name="run",
                       config={}, config_yaml="k_outer: 3", run_id="run-x")
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
try:
    for step in range(1, 10000):
        tracker.log(step, {f"loss/node_{i}": 0.5 for i in range(64)})
except UserError as e:
    print(e)
    sys.exit(2)
finally:
    tracker.close()
print("no error")
"""


def test_a_full_tracking_dir_is_one_error_naming_it_and_no_thread_traceback(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    folder = str(tmp_path / "tracking")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", FULL_TRACKING_DIR, folder], capture_output=True, text=True,
                          env=env, cwd=str(tmp_path), timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout.strip() == (f"cannot write TensorBoard events to tracking_dir {folder}: File too large "
                                   "(check its free space and permissions, choose another tracking_dir=, or "
                                   "drop tensorboard from report_to)")


def test_a_tracking_dir_removed_under_the_run_is_one_error_naming_it(tmp_path):
    import shutil

    folder = str(tmp_path / "tracking")
    tracker = open_tracker(TrackingConfig(report_to="tensorboard"), rank=0, folder=folder, name="run",
                           config={}, config_yaml="k_outer: 3", run_id="run-x")
    tracker.log(1, {"loss/node_0": 1.0})
    shutil.rmtree(folder)
    with pytest.raises(UserError, match=rf"cannot write TensorBoard events to tracking_dir {folder}: its event "
                                        r"file .* was removed during the run"):
        tracker.log(2, {"loss/node_0": 2.0})
    tracker.close()
