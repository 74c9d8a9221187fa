"""The CPU default (``configs/cpu/standin_onpolicy.yaml``: on-policy collection on the shipped
stand-in backbone, 4 seats) under torchrun with ``report_to=tensorboard``, shortened (fewer
anchors and rounds, the 4 seats on 2 gloo ranks): its event files hold the report's per-round
primal residuals for every node, and ``python -m admm_dist.plot`` draws its report. About 15 s
on 2 cores."""
import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from admm_dist.training.tracking import event_files

from conftest import REPO

pytestmark = pytest.mark.slow
SHORT = ["anchors=16", "k_outer=2", "local_steps=2"]   # 2 rounds: a curve per node, one collection


def test_the_cpu_default_tracked_in_tensorboard_and_plotted(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    out, res = tmp_path / "runs" / "standin_onpolicy", tmp_path / "results"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "admm_dist.train", "--config", "configs/cpu/standin_onpolicy.yaml", f"out={out}",
                    f"report_dir={res}", "report_to=tensorboard", "quiet=true", *SHORT],
                   cwd=REPO, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)
    report = json.loads((res / "standin_onpolicy-train.json").read_text())
    folder = res / "tracking" / "standin_onpolicy"
    assert len(event_files(str(folder))) == 1
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    assert report["n_nodes"] == 4 and len(report["rounds"]) == report["config"]["k_outer"]
    for i in range(report["n_nodes"]):
        events = acc.Scalars(f"primal_residual_normalized/node_{i}")
        assert [e.step for e in events] == [r["round"] for r in report["rounds"]]
        # TensorBoard stores float32: equal to that precision
        assert [e.value for e in events] == pytest.approx([r["primal_normalized"][i] for r in report["rounds"]],
                                                          rel=1e-6)

    plots = tmp_path / "plots"
    subprocess.run([sys.executable, "-m", "admm_dist.plot", str(res / "standin_onpolicy-train.json"),
                    "--out", str(plots)], cwd=REPO, check=True, timeout=120, capture_output=True)
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["standin_onpolicy-bytes.png", "standin_onpolicy-objectives.png",
                     "standin_onpolicy-residuals.png"]
    for name in names:
        with Image.open(plots / name) as im:
            assert im.format == "PNG" and im.size[0] > 400 and im.size[1] > 300
