"""The test-only fault plan (tests/faults.py): its spec, its kills inside a checkpoint write at
each point (an audit hook, in a forked child), and the package that knows nothing of it."""
import ast
import multiprocessing
import os
import signal

import pytest
import torch

import faults
from admm_dist.core.errors import UserError
from admm_dist.training import checkpoint as ckpt

from conftest import REPO


def test_the_spec_names_a_kill_a_nan_or_a_point_of_a_checkpoint_write():
    assert faults.FaultPlan.parse("3:1") == faults.FaultPlan("kill", 3, 1)
    assert faults.FaultPlan.parse("nan@2:0") == faults.FaultPlan("nan", 2, 0)
    assert faults.FaultPlan.parse("ckpt@2:1:json-renaming") == faults.FaultPlan("ckpt", 2, 1, "json-renaming")
    for bad in ("3", "a:1", "ckpt@2:1", "ckpt@2:1:elsewhere", "nan@2:1:tensors"):
        with pytest.raises(UserError, match=faults.ENV):
            faults.FaultPlan.parse(bad)


def _write(root, spec, restart):
    """In a forked child: arm ``spec``, write nodes 0 and 1 of rounds 1 and 2, exit 0 if alive."""
    os.environ["TORCHELASTIC_RESTART_COUNT"] = restart
    faults.install(spec)
    for k in (1, 2):
        for node in (0, 1):
            ckpt.save_node(root, k, node, {"x": torch.zeros(3)}, {"k": k})
    os._exit(0)


def _run(root, spec, restart="0"):
    p = multiprocessing.get_context("fork").Process(target=_write, args=(str(root), spec, restart))
    p.start()
    p.join(60)
    return p.exitcode


def _names(folder):
    return sorted(f if not f.endswith(".tmp") else f.split(".")[1] + "." + f.split(".")[2] + ".tmp"
                  for f in os.listdir(folder))


LEFT = {   # what round 2's folder holds when node 1's write of it is killed at each point
    "tensors": ["node-0.json", "node-0.safetensors"],
    "tensors-renaming": ["node-0.json", "node-0.safetensors", "node-1.safetensors.tmp"],
    "tensors-written": ["node-0.json", "node-0.safetensors", "node-1.safetensors"],
    "json-renaming": ["node-0.json", "node-0.safetensors", "node-1.json.tmp", "node-1.safetensors"],
    "json-written": ["node-0.json", "node-0.safetensors", "node-1.json", "node-1.safetensors"],
}


@pytest.mark.parametrize("point", faults.POINTS)
def test_a_checkpoint_write_is_killed_at_its_point_on_the_first_attempt_only(tmp_path, point):
    assert set(LEFT) == set(faults.POINTS)
    root = tmp_path / "run.ckpt"
    assert _run(root, f"ckpt@2:1:{point}") == -signal.SIGKILL
    assert _names(root / "round-000001") == ["node-0.json", "node-0.safetensors", "node-1.json",
                                             "node-1.safetensors"]
    assert _names(root / "round-000002") == LEFT[point]
    assert ckpt.completed_rounds(str(root), [0, 1]) == ([1, 2] if point == "json-written" else [1])
    assert _run(tmp_path / "again", f"ckpt@2:1:{point}", restart="1") == 0   # an elastic restart
    assert ckpt.completed_rounds(str(tmp_path / "again"), [0, 1]) == [1, 2]


def test_no_plan_and_disarming_leave_the_trainer_as_it_is():
    from admm_dist.training.trainer import Trainer

    before = dict(Trainer.__dict__)
    with faults.armed("nan@1:0") as plan:
        assert plan == faults.FaultPlan("nan", 1, 0) and Trainer.__dict__["xstep"] is not before["xstep"]
    assert dict(Trainer.__dict__) == before
    faults.install(None)
    assert dict(Trainer.__dict__) == before


def test_the_package_never_imports_the_tests():
    found = []
    for folder, _, files in os.walk(REPO / "admm_dist"):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                    mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                    found += [f"{path}: {m}" for m in mods if m.split(".")[0] in ("tests", "faults")]
    assert found == []
