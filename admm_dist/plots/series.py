"""The plot command's inputs, read, recognised by their content and checked, as small typed series.

Three kinds (:func:`kind_of`):

- ``"train"``: a training report (``<name>-train.json``, written by ``python -m admm_dist.train``):
  a ``rounds`` list of per-round records with one value per node -> :class:`TrainSeries`;
- ``"eval"``: an evaluation result (``python -m admm_dist.evaluate --json``): ``accuracy``,
  ``n``, ``correct``, ``task`` -> :class:`EvalPoint`, with its 95% Wilson interval;
- ``"bench"``: a benchmark summary (``docs/bench_fidelity.json``): ``modes`` -> mode -> arm
  -> per-seed accuracies -> :class:`BenchSummary`.

Pure Python: nothing here imports matplotlib. A bad file is a one-line
:class:`~admm_dist.core.errors.UserError` that names it.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from admm_dist.core.errors import UserError
from admm_dist.core.io import read_json

TRAIN_SUFFIX = "-train.json"
BASE_ARM = "base"
Z95 = 1.959963984540054          # the standard normal's 97.5% quantile
NODE_FIELDS = ("f", "primal_normalized", "dual", "bytes_sent", "bytes_recv")
EVAL_KEYS = ("accuracy", "n", "correct", "task")
KINDS = ("a training report (a 'rounds' list, from python -m admm_dist.train), an evaluation "
         "result ('accuracy', 'n', 'correct', 'task', from python -m admm_dist.evaluate --json) "
         "or a benchmark summary ('modes', like docs/bench_fidelity.json)")

PerNode = list[list[float]]      # [node][round]


@dataclasses.dataclass(frozen=True)
class TrainSeries:
    """One training run. Per-node fields are ``[node][k]``, the value at round ``rounds[k]``;
    a value the report wrote as null (it was not finite) is NaN."""

    name: str
    source: str
    rounds: list[int]
    f: PerNode                   # local objective f_i
    primal_normalized: PerNode   # ||x_i - z_i|| / ||z_i||
    dual: PerNode                # rho ||z_i^k - z_i^{k-1}||
    bytes_sent: PerNode          # bytes this round
    bytes_recv: PerNode
    dev_rounds: list[int]        # held-out NLL of the consensus z (empty: no dev split)
    dev_nll: list[float]
    fit_mode: str = ""           # what f is: "dpo", "sft", ... ("" when the config does not say)

    @property
    def n_nodes(self) -> int:
        return len(self.f)


@dataclasses.dataclass(frozen=True)
class EvalPoint:
    """One evaluation: accuracy = correct / n, and its 95% Wilson interval [lo, hi]."""

    name: str
    source: str
    task: str
    accuracy: float
    n: int                       # trials: the chains scored (n_chains when the file has it)
    correct: int
    lo: float
    hi: float


@dataclasses.dataclass(frozen=True)
class ArmBars:
    """One arm in one mode: its per-seed accuracies, their mean, and the 95% CI of its gain
    over the base placed at the base (``mean - gain + gain_ci95``; None for the base)."""

    name: str
    accuracy: list[float]
    mean: float
    ci: tuple[float, float] | None


@dataclasses.dataclass(frozen=True)
class BenchSummary:
    """A benchmark summary: per mode, its arms (the base first, refused arms left out)."""

    source: str
    seeds: int
    eval_n: int | None
    modes: dict[str, list[ArmBars]]

    def base_mean(self, mode: str) -> float:
        return self.modes[mode][0].mean


Series = TrainSeries | EvalPoint | BenchSummary


def kind_of(obj: Any) -> str | None:
    """``"train"``, ``"eval"`` or ``"bench"`` from what ``obj`` holds; None for anything else."""
    if not isinstance(obj, dict):
        return None
    rounds = obj.get("rounds")
    if isinstance(rounds, list) and all(isinstance(r, dict) and "f" in r for r in rounds):
        return "train"
    if all(k in obj for k in EVAL_KEYS):
        return "eval"
    if isinstance(obj.get("modes"), dict):
        return "bench"
    return None


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of ``correct`` successes in ``n`` trials (95% by default)."""
    if n <= 0 or not 0 <= correct <= n:
        raise ValueError(f"wilson needs 0 <= correct <= n and n > 0, got {correct}/{n}")
    p = correct / n
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, centre - half), min(1.0, centre + half)


def load(path: str) -> Series:
    """The series in the JSON file ``path``, whichever kind it is."""
    obj = read_json(path, "plot input")
    kind = kind_of(obj)
    if kind == "train":
        return train_series(obj, path)
    if kind == "eval":
        return eval_point(obj, path)
    if kind == "bench":
        return bench_summary(obj, path)
    raise UserError(f"plot input {path} is none of {KINDS}: pass one of those")


def run_name(path: str) -> str:
    """``runs/x/smollm2-train.json`` -> ``smollm2``; any other ``a/b.json`` -> ``b``."""
    base = os.path.basename(path)
    for suffix in (TRAIN_SUFFIX, ".json"):
        if base.endswith(suffix) and len(base) > len(suffix):
            return base[:-len(suffix)]
    return base


# ---------------------------------------------------------------------------- training reports
def train_series(report: dict[str, Any], path: str) -> TrainSeries:
    rounds = report["rounds"]
    if not rounds:
        raise UserError(f"training report {path} has no rounds: plot a run that finished a round")
    n = _node_count(rounds[0], path)
    fields = {key: _per_node(rounds, key, n, path) for key in NODE_FIELDS}
    dev = report.get("dev_curve") or []
    where = f"training report {path}: dev_curve"
    config = report.get("config")
    return TrainSeries(
        name=run_name(path), source=path,
        rounds=[_integer(r.get("round"), f"training report {path}: round {k}'s 'round'")
                for k, r in enumerate(rounds, 1)],
        dev_rounds=[_integer(_item(p, "round", where), where) for p in dev],
        dev_nll=[_number(_item(p, "dev_nll", where), where) for p in dev],
        fit_mode=str(config.get("fit_mode") or "") if isinstance(config, dict) else "",
        **fields)


def _node_count(first: dict[str, Any], path: str) -> int:
    f = first.get("f")
    if not isinstance(f, list) or not f:
        raise UserError(f"training report {path}: round 1's 'f' is not a list with one value per "
                        f"node: pass a report written by python -m admm_dist.train")
    return len(f)


def _per_node(rounds: list[dict[str, Any]], key: str, n: int, path: str) -> PerNode:
    """``rounds[k][key][i]`` as ``[i][k]``; every round must have ``n`` values."""
    table = []
    for k, record in enumerate(rounds, 1):
        values = record.get(key)
        where = f"training report {path}: round {k}'s '{key}'"
        if not isinstance(values, list) or len(values) != n:
            raise UserError(f"{where} is not a list of {n} node values (one per node, as round 1's "
                            f"'f'): pass a complete report written by python -m admm_dist.train")
        table.append([_number(v, where) for v in values])
    return [list(col) for col in zip(*table)]


def _item(point: Any, key: str, where: str) -> Any:
    if not isinstance(point, dict) or key not in point:
        raise UserError(f"{where}: every point needs '{key}' (a list of {{\"round\", \"dev_nll\"}})")
    return point[key]


def _number(value: Any, where: str) -> float:
    """A JSON number as a float; null (a non-finite value the writer dropped) is NaN."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where} holds {value!r}, not a number")
    return float(value)


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{where} is {value!r}, not a whole number")
    return value


# ---------------------------------------------------------------------------- evaluation results
def eval_point(result: dict[str, Any], path: str) -> EvalPoint:
    where = f"evaluation result {path}"
    trials = _integer(result.get("n_chains", result["n"]), f"{where}: 'n'")
    correct = _integer(result["correct"], f"{where}: 'correct'")
    if trials <= 0 or not 0 <= correct <= trials:
        raise UserError(f"{where}: correct={correct} of n={trials} is not a count of successes "
                        f"(0 <= correct <= n, n > 0): pass the file evaluate --json wrote")
    lo, hi = wilson(correct, trials)
    return EvalPoint(name=run_name(path), source=path, task=str(result["task"]),
                     accuracy=_number(result["accuracy"], f"{where}: 'accuracy'"),
                     n=trials, correct=correct, lo=lo, hi=hi)


# ---------------------------------------------------------------------------- benchmark summaries
def bench_summary(summary: dict[str, Any], path: str) -> BenchSummary:
    modes = {mode: _arms(table, f"benchmark summary {path}: mode '{mode}'")
             for mode, table in summary["modes"].items()}
    if not modes:
        raise UserError(f"benchmark summary {path} has no modes: pass a finished benchmark's summary")
    seeds = summary.get("seeds")
    eval_n = summary.get("eval_n")
    return BenchSummary(source=path, seeds=len(seeds) if isinstance(seeds, list) else int(seeds or 0),
                        eval_n=eval_n if isinstance(eval_n, int) else None, modes=modes)


def _arms(table: Any, where: str) -> list[ArmBars]:
    if not isinstance(table, dict) or not isinstance(table.get(BASE_ARM), dict):
        raise UserError(f"{where} has no '{BASE_ARM}' arm: every mode needs the base to compare with")
    names = [BASE_ARM] + [a for a in table if a != BASE_ARM]
    return [_arm(a, table[a], f"{where}, arm '{a}'") for a in names
            if not (isinstance(table[a], dict) and "refused" in table[a])]


def _arm(name: str, record: Any, where: str) -> ArmBars:
    if not isinstance(record, dict) or not isinstance(record.get("accuracy"), list):
        raise UserError(f"{where} has no 'accuracy' list (one value per seed)")
    accuracy = [_number(a, f"{where}: 'accuracy'") for a in record["accuracy"]]
    mean = _number(record.get("mean"), f"{where}: 'mean'")
    ci = None
    if "gain_ci95" in record:
        ci_pair = record["gain_ci95"]
        if not (isinstance(ci_pair, list) and len(ci_pair) == 2):
            raise UserError(f"{where}: 'gain_ci95' is not a [lo, hi] pair")
        at = mean - _number(record.get("gain"), f"{where}: 'gain'")
        lo, hi = (_number(v, f"{where}: 'gain_ci95'") for v in ci_pair)
        ci = (at + lo, at + hi)
    return ArmBars(name=name, accuracy=accuracy, mean=mean, ci=ci)
