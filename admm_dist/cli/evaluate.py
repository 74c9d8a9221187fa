"""``python -m admm_dist.evaluate`` / ``admm-dist-evaluate``: the evaluation command's arguments.

What it does is :mod:`admm_dist.mas.evaluation` (its docstring is this command's help). The
settings evaluation shares with training (:data:`SHARED`) are the training keys' own: their help
and choices come from :class:`~admm_dist.training.config.TrainConfig`'s field metadata, and
``--config RUN.yaml`` (a training config, or a run's ``<out>/config.yaml``) supplies their
values, which explicit flags override (:func:`resolve`, which the parser runs: its namespace is
complete, so a caller may hand it straight to :func:`admm_dist.mas.evaluation.run`).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from admm_dist import tasks
from admm_dist.cli.common import OneLineParser, run_cli
from admm_dist.core import config_file
from admm_dist.core.config_file import ConfigError, default_of, shown
from admm_dist.core.errors import UserError, one_line
from admm_dist.mas import evaluation
from admm_dist.training.config import TrainConfig

PROG = "admm-dist-evaluate"
__doc__ = evaluation.__doc__
# evaluation's flag -> the training key it shares (the same name but for batch_size)
SHARED = {name: name for name in (
    "task", "task_path", "n_ops", "model_name", "seed", "n_agents", "prompt", "think",
    "text_mas_context_length", "adapt_roles", "max_new_tokens", "top_p", "generation_backend", "agent_models",
    "device", "dtype")}
SHARED["batch_size"] = "gen_batch_size"
# without --config these stay unset: the deployed run's (--adapter/--state) value applies
FROM_RUN = {"model_name": "the deployed run's", "adapt_roles": "the deployed run's, else all",
            "task": "required"}
TRAIN_HELP = "python -m admm_dist.train --help"


def _shared(p: argparse.ArgumentParser, name: str, help: Optional[str] = None, **kwargs) -> None:
    """``--name``, a setting shared with training: unset (None) unless given, so that
    :func:`resolve` can tell a flag from a default."""
    key = SHARED[name]
    meta = config_file.meta(TrainConfig, key)
    fallback = FROM_RUN.get(name) or shown(default_of(TrainConfig, key))
    text = f"{help or meta['help']} (default: --config's, else {fallback})".replace("%", "%%")
    tp = config_file.value_type(TrainConfig, key)
    if tp is bool:
        p.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=None, help=text)
        return
    kwargs.setdefault("choices", meta["choices"])
    metavar = None if kwargs["choices"] else config_file.metavar_of(TrainConfig, key)
    p.add_argument(f"--{name}", type=tp, default=None, metavar=metavar, help=text, **kwargs)


class EvalParser(OneLineParser):
    """Parses, then fills the shared settings (:func:`resolve`); a bad ``--config`` is one line."""

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        try:
            return resolve(ns), rest
        except UserError as e:
            self.error(one_line(e))


def build_parser() -> EvalParser:
    p = EvalParser(prog=PROG, description=evaluation.__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--config", default=None, metavar="RUN.yaml",
      help="a training config (configs/*.yaml, or a run's <out>/config.yaml): the model, task, chain and "
           "prompt settings below default to its values; flags override them")
    _shared(p, "task", f"the task to evaluate: {', '.join(sorted(tasks.REGISTRY))}")
    _shared(p, "task_path")
    _shared(p, "n_ops")
    a("--split", default=None, metavar="SPLIT", help="task split (default: the task's evaluation split)")
    _shared(p, "model_name")
    _shared(p, "seed", "seed of the pool shuffle and of sampling")
    a("--n", type=int, default=None, metavar="N", help="number of rows (default: all)")
    a("--offset", type=int, default=0, metavar="N", help="first row (default: 0)")
    _shared(p, "n_agents")
    _shared(p, "prompt",
            config_file.meta(TrainConfig, "prompt")["help"] + "; --config gives its fit_prompt if set")
    _shared(p, "think")
    _shared(p, "text_mas_context_length")
    _shared(p, "adapt_roles")
    _shared(p, "max_new_tokens")
    a("--temperature", type=float, default=0.0, metavar="X", help="0: greedy; > 0 samples (default: 0)")
    _shared(p, "top_p")
    a("--samples", type=int, default=1, metavar="N",
      help="chains per row; more than 1 needs --temperature > 0 (default: 1)")
    _shared(p, "batch_size")
    _shared(p, "generation_backend")
    a("--adapter", default=None, metavar="FILE",
      help="a saved B vector (<out>-last.safetensors or <out>-best.safetensors) on every adapted seat")
    a("--deploy", choices=("consensus", "local"), default="consensus",
      help="with --state: every seat runs the consensus z, or each its own node's state (default: consensus)")
    a("--state", default=None, metavar="DIR",
      help="a training run's <out> folder (node-<i>.safetensors, seat_map.json)")
    _shared(p, "agent_models")
    a("--judge", default=None, metavar="MODEL", help="judge model for safety tasks (a folder or hub id)")
    a("--train_report", default=None, metavar="FILE",
      help="a training report (<name>-train.json) whose anchor_keys must not be evaluated (default: the "
           "one the adapter names or that lies next to the run)")
    a("--save_trajectories", default=None, metavar="FILE.jsonl", help="write every chain's messages here")
    a("--json", default=None, metavar="FILE", help="write the summary here")
    _shared(p, "dtype")
    _shared(p, "device")   # auto, cpu, cuda or cuda:N: the training key's help; checked by evaluation
    return p


def read_config(path: str) -> TrainConfig:
    """A training config file, checked as the trainer checks it; a bad one is one line."""
    try:
        return config_file.build(TrainConfig, (path, config_file.load_yaml(path)), listed_by=TRAIN_HELP)
    except UserError as e:
        msg = str(e)
        raise ConfigError(msg if path in msg
                          else f"--config {path} is not a valid training config: {msg}") from None


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every shared setting not given as a flag: from ``--config`` (the deployment prompt: its
    ``fit_prompt`` when set), else the training default; ``model_name`` and ``adapt_roles`` stay
    unset without a config (evaluation then takes the deployed run's)."""
    run = read_config(args.config) if args.config else None
    for name, key in SHARED.items():
        if getattr(args, name) is not None:
            continue
        if run is not None:
            value = (run.fit_prompt or run.prompt) if name == "prompt" else getattr(run, key)
        else:
            value = None if name in FROM_RUN else default_of(TrainConfig, key)
        setattr(args, name, value)
    if args.task is None:
        raise UserError("pass --task NAME (the task to evaluate), or --config RUN.yaml of a run that "
                        "collected on one")
    if run is not None and args.task not in tasks.REGISTRY:
        raise UserError(f"--config {args.config} has task={args.task!r} (a pre-built fit set's label, not a "
                        f"task): pass --task NAME, one of {', '.join(sorted(tasks.REGISTRY))}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(PROG, evaluation.evaluate, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
