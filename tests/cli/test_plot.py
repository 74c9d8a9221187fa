"""``python -m admm_dist.plot`` as a user runs it: two training reports, two evaluation results
and the shipped benchmark summary in, PNGs of the declared sizes with their Title and Source
out; a file that is none of the kinds, or is missing, is one line on stderr and exit code 2."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import REPO
from PIL import Image

from admm_dist.cli.plot import main
from admm_dist.plots.figures import size_px

NODES, ROUNDS = 3, 4


def report(scale: float) -> dict:
    """A 3-node, 4-round training report with a dev curve, as the trainer writes it."""
    def row(k: int, field: str) -> list:
        return [scale * (1 + i) / (k + 1) if field != "bytes" else 4096 * (i + 1) for i in range(NODES)]
    rounds = [{"round": k, "f": row(k, "f"), "primal": row(k, "p"), "primal_normalized": row(k, "p"),
               "dual": row(k, "d"), "bytes_sent": row(k, "bytes"), "bytes_recv": row(k, "bytes"),
               "sec_x": row(k, "s"), "sec_z": row(k, "s"), "sec_other": row(k, "s"),
               "x1_norm": 0.1, "rho": 1.0} for k in range(1, ROUNDS + 1)]
    return {"config": {"out": "runs/x", "fit_mode": "sft"}, "rounds": rounds,
            "dev_curve": [{"round": k, "dev_nll": 1.0 / k} for k in range(1, ROUNDS + 1)]}


def write(path, obj: dict) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


@pytest.fixture
def inputs(tmp_path):
    runs = [write(tmp_path / "alpha-train.json", report(1.0)), write(tmp_path / "beta-train.json", report(2.0))]
    evals = [write(tmp_path / f"{name}.json", {"task": "chain_arith", "n": 400, "n_chains": 400,
                                                "correct": c, "accuracy": c / 400})
             for name, c in (("before", 186), ("after", 269))]
    bench = str(tmp_path / "bench_fidelity.json")
    shutil.copy(REPO / "docs" / "bench_fidelity.json", bench)
    return runs, evals, bench


def test_the_command_writes_every_figure(tmp_path, inputs, capsys):
    runs, evals, bench = inputs
    out = tmp_path / "out" / "figs"
    code = main([*runs, *evals, bench, "--out", str(out)])   # the command's main, in this process
    said = capsys.readouterr()
    assert code == 0, said.err[-2000:]
    modes = len(json.loads((REPO / "docs" / "bench_fidelity.json").read_text())["modes"])
    want = {}                                         # file -> (panels, source)
    for name, src in zip(("alpha", "beta"), runs):
        want.update({f"{name}-objectives.png": (2, src), f"{name}-residuals.png": (2, src),
                     f"{name}-bytes.png": (2, src)})
    want.update({"compare-residuals.png": (1, "; ".join(runs)), "compare-objectives.png": (1, "; ".join(runs)),
                 "accuracy.png": (1, "; ".join(evals)), "accuracy-by-arm.png": (modes, bench)})
    assert said.out.splitlines() == [f"wrote {out / name}" for name in want]
    assert sorted(p.name for p in out.iterdir()) == sorted(want)
    for name, (panels, source) in want.items():
        assert (out / name).stat().st_size > 0
        with Image.open(out / name) as im:
            assert im.format == "PNG" and im.size == size_px(panels), name
            assert im.info["Source"] == source and im.info["Title"], name


@pytest.mark.parametrize("bad, words", [("junk", "is none of a training report"), ("missing", "does not exist")])
def test_a_bad_input_is_one_line_and_exit_code_2(tmp_path, inputs, capsys, bad, words):
    path = tmp_path / "bad.json"
    if bad == "junk":
        path.write_text(json.dumps({"loss": [1, 2]}))
    assert main([inputs[0][0], str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and str(path) in err
    assert not (tmp_path / "out").exists()            # every input is checked before drawing
