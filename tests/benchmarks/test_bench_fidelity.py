"""The learning benchmark end to end on tiny settings (one seed): its table, JSON and figure.

Nothing here depends on training helping: the checks are on the structure and the arithmetic
of the statistics, which hold for any outcome."""
import contextlib
import io
import json
import subprocess

import numpy as np
import pytest
import torch

from benchmarks import fidelity
from benchmarks.fidelity_run import ARM_NAMES, BASE, REFERENCE
from benchmarks.fidelity_stats import SINGLE, crossed_bootstrap, format_table

from conftest import REPO

TINY = ["anchors=6", "group=4", "k_outer=2", "local_steps=1", "gen_chunk=8", "max_new_tokens=12"]
EVAL_N, SAMPLED_N = 4, 2     # held-out rows scored greedy; the front ones scored sampled and along the curve
# one arm of each kind (every arm trains through the same code, and tests/training checks each
# one's numbers against the single-process run): the reference, one deployed per seat with
# compressed exchange, the pooled one; and an ablation that the override below makes invalid.
# recollect_every=1 with k_outer=2: a second collection (2 fresh queries), each arm's own, after round 1
RUN = ("ADMM-ring", "ADMM-decentralized-int8", "Centralized")
REFUSED = "ADMM-NoDual"


class _JobsInThisProcess:
    """What the benchmark's worker threads see as ``subprocess``: a job's command (``python -m
    benchmarks.fidelity ARGV --job JOB``) runs as that interpreter would run it, fidelity.main
    with its arguments, but in this process, whose torch, transformers and PEFT are imported
    already: the start-up of an interpreter was three quarters of a job's time here (about 25 of
    the run's 35 s of CPU). The jobs run one at a time (--jobs 1: never two trainings in one
    process at once). The worker as a process of its own, and its failure's one line, are
    test_a_seeds_fit_set_of_other_settings_stops_the_run_in_one_line's (and, with a job that
    succeeds, the slow test_select_best_deploys_...)."""
    TimeoutExpired = subprocess.TimeoutExpired

    @staticmethod
    def run(cmd, env=None, capture_output=True, text=True, timeout=None):
        assert cmd[1:3] == ["-m", "benchmarks.fidelity"] and "--job" in cmd, cmd
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = fidelity.main(cmd[3:])
        return subprocess.CompletedProcess(cmd, rc, "", err.getvalue())


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fidelity")
    out = tmp / "b.json"
    png = tmp / "b.png"
    argv = ["--seeds", "3", "--eval_n", str(EVAL_N), "--sampled_n", str(SAMPLED_N), "--samples", "2",
            "--boot", "200", "--jobs", "1", "--arms", ",".join((*RUN, REFUSED)),
            "--workdir", str(tmp / "work"), "--json", str(out), "--png", str(png), *TINY, "rho_adapt=true",
            "recollect_every=1", "recollect_anchors=2"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fidelity, "subprocess", _JobsInThisProcess)
        rc = fidelity.main(argv)
    return rc, json.loads(out.read_text()) if out.exists() else None, png, tmp, argv


def test_every_arm_asked_for_runs_and_writes_json_and_png(bench, capsys):
    rc, summary, png, tmp, _ = bench
    assert rc == 0 and summary is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(summary["modes"]) == {"greedy", "sampled"}
    for mode, table in summary["modes"].items():
        assert set(table) == {BASE, *RUN, REFUSED} | ({SINGLE} if mode == "greedy" else set())
        base = table[BASE]["mean"]
        for name in RUN:
            r = table[name]
            assert "refused" not in r, (name, r)
            assert len(r["accuracy"]) == 1 and 0 <= r["accuracy"][0] <= 1
            assert r["gain"] == pytest.approx(r["mean"] - base)
            lo, hi = r["gain_ci95"]
            assert lo <= r["gain"] + 1e-12 and r["gain"] <= hi + 1e-12
            assert r["wins"] == int(r["gain"] > 0)
            if name != REFERENCE:
                ring = table[REFERENCE]["mean"]
                assert r["minus_ref"] == pytest.approx(r["mean"] - ring)
    for name in RUN:
        arm = summary["arms"][name]
        assert len(arm["f"][0]) == 2 and len(arm["primal_normalized"][0]) == 2   # k_outer rounds
        # two collections: the seed's shared first one, then the arm's own
        assert len(arm["pass_rates"][0]) == 2 and all(0 <= r <= 1 for r in arm["pass_rates"][0])
    first = {summary["arms"][name]["pass_rates"][0][0] for name in RUN}
    assert len(first) == 1                       # every arm started from the same collection
    assert summary["collection"][0]["mean_pass_rate"] in first   # the seed's shared one, not an arm's last
    # greedy on the EVAL_N front rows, sampled (2 chains a row) and the curve on the front SAMPLED_N of them
    work = tmp / "work"
    base_rows = json.loads((work / "base.json").read_text())["rows"]
    assert len(base_rows["greedy"]) == EVAL_N and len(base_rows["sampled"]) == SAMPLED_N
    assert base_rows["sampled_anchors"] == base_rows["greedy_anchors"][:SAMPLED_N]
    assert summary["eval_n"] == EVAL_N and summary["sampled_n"] == SAMPLED_N
    # the untrained single seat, greedy on the chain's rows, and each arm against it, paired per row
    single = json.loads((work / "base.json").read_text())["single"]
    assert single["greedy_anchors"] == base_rows["greedy_anchors"] and "sampled" not in single
    greedy = summary["modes"]["greedy"]
    assert greedy[SINGLE]["mean"] == pytest.approx(sum(single["greedy"]) / EVAL_N)
    assert SINGLE not in summary["modes"]["sampled"]
    for name in RUN:
        r = greedy[name]
        assert r["minus_single"] == pytest.approx(r["mean"] - greedy[SINGLE]["mean"])
        assert r["minus_single_ci95"][0] <= r["minus_single"] + 1e-12 <= r["minus_single_ci95"][1] + 2e-12
    # the learning curve: each consensus arm's z after round 1 (one collection) and round 2 (two)
    curves = summary["curves"]
    assert set(curves) == {"ADMM-ring", "Centralized"}         # decentralized deploys per seat
    for name, c in curves.items():
        assert [p["round"] for p in c["points"]] == [1, 2] and [p["collections"] for p in c["points"]] == [1, 2]
        assert c["rows"] == SAMPLED_N
        assert c["base"] == pytest.approx(sum(base_rows["greedy"][:SAMPLED_N]) / SAMPLED_N)
        final = json.loads((work / f"seed3-{name}.json").read_text())["result"]["rows"]["greedy"]
        last = c["points"][-1]
        assert last["accuracy"] == [pytest.approx(sum(final[:SAMPLED_N]) / SAMPLED_N)]   # the -last adapter
        for p in c["points"]:
            assert p["gain"] == pytest.approx(p["mean"] - c["base"])
            assert p["gain_ci95"][0] <= p["gain"] + 1e-12 <= p["gain_ci95"][1] + 2e-12
    assert fidelity.curve_png(str(png)).endswith("b-curve.png")
    assert open(fidelity.curve_png(str(png)), "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"
    # Centralized is at distance 0 from itself; per-seat arms have one distance per seat
    assert summary["arms"]["Centralized"]["distance_to_centralized"][0] == [0.0] * 4


def test_table_lists_every_arm(bench, capsys):
    _, summary, _, _, _ = bench

    class A:
        samples, eval_n, sampled_n, arm_list = 2, EVAL_N, SAMPLED_N, [*RUN, REFUSED]
    text = format_table(summary, A)
    for name in (BASE, *RUN, REFUSED):
        assert name in text
    assert f"greedy accuracy on {EVAL_N} held-out rows" in text
    assert f"sampled accuracy on {SAMPLED_N} held-out rows" in text
    assert f"greedy gain over the base along training on the front {SAMPLED_N} rows" in text
    greedy = text.split("greedy accuracy", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    rows = {line.split()[0]: line for line in greedy}
    # the arm column fits the longest name: rows with the same figures have the same length
    assert len(rows["ADMM-decentralized-int8"]) == len(rows["Centralized"])
    rates = text.split("collections' pass rates", 1)[1].splitlines()
    assert rates[1].split() == ["arm", "c0", "c1"] and any(r.startswith("ADMM-ring ") for r in rates)
    alone = text.split("the untrained model alone", 1)[1].split("\n\n", 1)[0].splitlines()
    assert f"greedy: {summary['modes']['greedy'][SINGLE]['mean']:.3f}" in alone[0]
    assert [r.split()[0] for r in alone[1:]] == list(RUN)
    curve = text.split("along training", 1)[1].splitlines()
    assert curve[1].split() == ["arm", "after", "round", "1", "after", "round", "2"]
    assert [r.split()[0] for r in curve[2:4]] == ["ADMM-ring", "Centralized"] and len(curve) == 4


def test_reuse_gives_the_same_summary(bench, tmp_path):
    rc, summary, _, tmp, argv = bench
    again = tmp / "again.json"
    argv = [a if a != str(tmp / "b.json") else str(again) for a in argv] + ["--reuse"]
    argv = [a for a in argv if a != str(tmp / "b.png")]
    argv.remove("--png")
    assert fidelity.main(argv) == 0
    other = json.loads(again.read_text())
    assert other["modes"] == summary["modes"]


def test_versus_pairs_every_arm_with_the_arm_named(bench, tmp_path, capsys):
    """--reuse --versus Centralized: the same jobs, the 'vs' column against Centralized."""
    rc, summary, _, tmp, argv = bench
    again = tmp / "versus.json"
    argv = [a if a != str(tmp / "b.json") else str(again) for a in argv if a != str(tmp / "b.png")]
    argv.remove("--png")
    capsys.readouterr()
    assert fidelity.main(argv + ["--reuse", "--versus", "Centralized"]) == 0
    text = capsys.readouterr().out
    other = json.loads(again.read_text())
    assert summary["versus"] == REFERENCE and other["versus"] == "Centralized"
    for mode, table in other["modes"].items():
        assert "minus_ref" not in table["Centralized"]
        for name in ("ADMM-ring", "ADMM-decentralized-int8"):
            r = table[name]
            assert r["minus_ref"] == pytest.approx(r["mean"] - table["Centralized"]["mean"])
            assert r["gain"] == summary["modes"][mode][name]["gain"]           # the same jobs
    assert "vs Centralized" in text and "vs ring" not in text


def test_crossed_bootstrap_covers_the_mean_and_narrows_with_rows():
    rng = np.random.default_rng(0)
    d_small = rng.normal(0.1, 1.0, size=(3, 50))
    d_big = rng.normal(0.1, 1.0, size=(3, 2000))
    lo_s, hi_s = crossed_bootstrap(d_small, 500)
    lo_b, hi_b = crossed_bootstrap(d_big, 500)
    assert lo_s < d_small.mean() < hi_s and lo_b < d_big.mean() < hi_b
    assert hi_b - lo_b < hi_s - lo_s
    # one seed: rows only; a constant difference has a zero-width interval
    assert crossed_bootstrap(np.full((1, 10), 0.25), 50) == pytest.approx((0.25, 0.25))


@pytest.mark.parametrize("argv, msg", [
    (["--seeds", "1,x"], "--seeds"),
    (["--seeds", "1,1"], "each once"),
    (["--arms", "ADMM-ring,Nope"], "unknown arm"),
    (["--eval_n", "0"], "--eval_n"),
    (["--eval_n", "10", "--sampled_n", "20"], "--sampled_n"),
    (["eta"], "key=value"),
    (["no_such_key=1"], "no_such_key"),
    (["--config", "configs/nope.yaml"], "does not exist"),
    (["--select", "best"], "dev_frac"),
    (["--arms", "ADMM-ring", "--versus", "Centralized"], "add it to --arms"),
    (["--config", "configs/cpu/smollm2_learn.yaml", "model_name=/nonexistent/smollm2"],
     "bash launch/install.sh smollm2 && python -m admm_dist.cli.pretrained smollm2 --out /nonexistent/smollm2"),
])
def test_bad_input_is_one_line(argv, msg, capsys):
    assert fidelity.main(argv + ["--workdir", "/nonexistent/never"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]


def test_an_arm_the_overrides_make_invalid_is_refused_not_the_run(bench):
    """rho_adapt is refused by the ablations (no_dual, local_only); the other arms still ran."""
    _, summary, _, _, _ = bench
    for table in summary["modes"].values():
        assert "rho_adapt" in table[REFUSED]["refused"]["3"]
        assert all("refused" not in table[name] for name in RUN)
    assert set(ARM_NAMES) >= {*RUN, REFUSED}


def test_jobs_run_base_then_every_seeds_collection_then_the_arms():
    """One job per seed and arm, after its seed's first collection: the workers stay busy to
    the end whatever the number of seeds (5 seeds on 2 workers no longer leave one idle)."""
    args = fidelity.parse_args(["--seeds", "4,5", "--arms", "ADMM-ring,Centralized"])
    assert fidelity.job_order(args) == [BASE, "seed4-collect", "seed5-collect", "seed4-ADMM-ring",
                                        "seed4-Centralized", "seed5-ADMM-ring", "seed5-Centralized"]


def test_the_ablations_keep_the_configs_rho_when_the_config_adapts_it(tmp_path):
    """A config with rho_adapt (the CPU default): the ADMM arms adapt rho, the ablations (no dual to rescale, or no
    coupling) run at the config's rho instead of being refused."""
    from benchmarks.fidelity_run import ARMS, base_config

    assert "\nrho_adapt: true" in (REPO / fidelity.DEFAULT_CONFIG).read_text()   # the CPU default adapts rho
    args = fidelity.parse_args(["--seeds", "1", "--workdir", str(tmp_path / "w")])
    got = {a.name: base_config(args, 1, a) for a in ARMS}
    assert got["ADMM-ring"].rho_adapt and got["ADMM-gossip"].rho_adapt
    assert not got["ADMM-NoDual"].rho_adapt and got["ADMM-NoDual"].no_dual
    assert not got["ADMM-Local"].rho_adapt and got["ADMM-Local"].local_only
    assert got["ADMM-NoDual"].rho == got["ADMM-ring"].rho
    # the GRPO arms: the same seats and ablations, by GRPO on a collection every round
    for name in ("ring", "Centralized", "Local", "NoDual"):
        grpo, same = got[f"GRPO-{name}"], got[name if name == "Centralized" else f"ADMM-{name}"]
        assert (grpo.fit_mode, grpo.recollect_every, same.fit_mode) == ("grpo", 1, "dpo"), name
        assert (grpo.pooled, grpo.local_only, grpo.no_dual, grpo.rho_adapt) == \
            (same.pooled, same.local_only, same.no_dual, same.rho_adapt), name


def test_a_seeds_fit_set_of_other_settings_stops_the_run_in_one_line(tmp_path, capsys):
    """A job's own refusal (here the seed's fitset_cache, built under other settings) reaches the
    user as one line naming the job and the fix, not a worker's traceback."""
    from admm_dist.demo.synthetic import write_fitset

    from benchmarks.fidelity_run import job_key

    (tmp_path / "w" / "seed3").mkdir(parents=True)
    write_fitset(str(tmp_path / "w" / "seed3" / "fitset.jsonl"), settings={"task": "synthetic", "n_agents": 4},
                 per_seat=2)
    argv = ["--seeds", "3", "--arms", "ADMM-ring", "--eval_n", "4", "--samples", "0",
            "--workdir", str(tmp_path / "w"), "--reuse", *TINY]
    # the base's rows from an earlier run, which --reuse keeps: the collection is the one job a
    # worker process starts for (an interpreter fewer)
    base = {"job": BASE, "key": job_key(fidelity.parse_args(argv), BASE), "rows": {"greedy": [0.0] * 4},
            "seconds": 0.0}
    (tmp_path / "w" / "base.json").write_text(json.dumps(base))
    rc = fidelity.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "job seed3-collect failed (exit 2)" in err[0] and "was built with different settings" in err[0]
    assert "Traceback" not in err[0]


@pytest.mark.slow   # a second benchmark run (one arm): the default suite's fixture covers -last
def test_select_best_deploys_the_round_with_the_lowest_held_out_nll(tmp_path):
    from benchmarks.fidelity_run import ARM_BY_NAME, base_config, score_rows

    argv = ["--seeds", "3", "--arms", REFERENCE, "--eval_n", "4", "--samples", "0", "--workdir", str(tmp_path / "w"),
            "--json", str(tmp_path / "b.json"), "--select", "best", *TINY, "recollect_every=1",
            "recollect_anchors=6", "dev_frac=0.25"]
    assert fidelity.main(argv) == 0
    summary = json.loads((tmp_path / "b.json").read_text())
    assert summary["select"] == "best"
    job = json.loads((tmp_path / "w" / f"seed3-{REFERENCE}.json").read_text())["result"]
    assert job["best"]["round"] in (1, 2) and job["best"]["dev_nll"] > 0
    args = fidelity.parse_args(argv)
    cfg = base_config(args, 3, ARM_BY_NAME[REFERENCE])
    best = cfg.out + "-best.safetensors"
    # the rows the table scored are those of the -best file's adapter
    report = f"{cfg.report_dir}/{cfg.out.rsplit('/', 1)[1]}-train.json"
    assert score_rows(args, cfg, ["--adapter", best, "--train_report", report], greedy_n=4, sampled_n=0)["greedy"] \
        == job["rows"]["greedy"]
    # the learning curve reads both rounds from their checkpoints
    assert [p["round"] for p in summary["curves"][REFERENCE]["points"]] == [1, 2]


def test_curvature_measures_the_trainers_objectives_at_a_rounds_z(bench, tmp_path, capsys):
    """benchmarks.curvature on this run's workdir: finite figures for every node with
    examples, and finite differences that behave as a Hessian's products (symmetric)."""
    from benchmarks import curvature

    _, _, _, tmp, _ = bench
    work = str(tmp / "work")
    with curvature.chain_point(work, 3, arm=REFERENCE, round_=1) as pt:
        assert pt.nodes and len(pt.node_sizes) == 4 and float(pt.z.norm()) > 0   # z of round 1, trained
        gen = torch.Generator().manual_seed(0)
        u, v = (torch.randn(pt.z.numel(), generator=gen, dtype=torch.float64) for _ in range(2))
        u, v = u / u.norm(), v / v.norm()
        node = pt.nodes[0]
        uhv = float(u @ curvature.hvp(pt.grad, node, pt.z, v, curvature.EPS))
        vhu = float(v @ curvature.hvp(pt.grad, node, pt.z, u, curvature.EPS))
        assert uhv == pytest.approx(vhu, rel=0.05, abs=1e-6)
    out = tmp_path / "c.json"
    argv = ["--workdir", work, "--seeds", "3", "--round", "1", "--probes", "1", "--lsq_rounds", "4",
            "--json", str(out)]
    assert curvature.main(argv) == 0
    r = json.loads(out.read_text())["seeds"]["3"]
    assert r["nodes"] == pt.nodes and r["gaps"] is None        # ADMM-NoDual was refused in this run
    assert len(r["probes"]) == 1 + len(pt.nodes) and all(np.isfinite(p["kappa"]) for p in r["probes"])
    assert 0 <= r["pooled"] <= 1
    assert "seed 3, round 1" in capsys.readouterr().out
