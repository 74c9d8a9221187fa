"""Every command's --help is plain text; the training command's help explains every key (meaning,
choices, default) by group, from the field metadata; evaluate --config takes a training config's
settings and flags override them."""
import contextlib
import dataclasses
import importlib
import io
import re

import pytest

from admm_dist.cli.evaluate import build_parser
from admm_dist.core.config_file import ConfigError, from_component, key, meta, shown
from admm_dist.core.text import plain
from admm_dist.mas import evaluation
from admm_dist.mas.collection import CREDITS
from admm_dist.mas.seats import ROLE_SETS
from admm_dist.training import config as train_config
from admm_dist.training.config import GROUPS, TrainConfig, help_text

from conftest import REPO

MARKUP = re.compile(r":[a-z]+:`|``")
COMMANDS = ("train", "evaluate", "plot", "build_fitset", "judge_fitset", "lsq", "pretrained", "standin",
            "synthetic")
STANDIN = str(REPO / "assets" / "standin")


def help_of(command: str) -> str:
    main = importlib.import_module(f"admm_dist.cli.{command}").main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = main(["--help"])
        except SystemExit as e:      # the commands that parse without run_cli
            rc = e.code
    assert rc == 0, command
    return out.getvalue()


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_plain_text(command):
    text = help_of(command)
    assert text.strip() and not MARKUP.search(text), MARKUP.search(text)


def test_plain_strips_roles_and_literals():
    assert plain("see :mod:`admm_dist.core` and :class:`~admm_dist.core.errors.UserError`, ``--rho 0.1``") \
        == "see admm_dist.core and UserError, --rho 0.1"


def test_every_key_has_help_a_group_and_its_choices():
    text = help_text()
    for f in dataclasses.fields(TrainConfig):
        m = f.metadata
        assert m.get("help", "").strip() and "\n" not in m["help"], f.name
        assert m.get("group") in GROUPS, f.name
        block = " ".join(re.split(rf"\n  --{f.name}\b(?!_)", "\n" + text)[1].split("\n  --", 1)[0].split())
        assert f"default: {shown(f.default)}" in block, f.name
        if m["choices"]:
            assert f"choices: {' | '.join(map(str, m['choices']))}" in block, f.name
    for group in GROUPS:
        assert f"\n{group}:\n" in "\n" + text
    assert "choices: all | nonsink | middle; default: all" in text and "default: 0.03" in text


def test_flat_keys_take_default_help_and_choices_from_the_component():
    from admm_dist.mas.chain import ChainConfig
    from admm_dist.mas.collection import Collector
    from admm_dist.model.adapter import LORA_TARGETS, AdapterConfig
    mirrored = {"lora_targets": (AdapterConfig, "lora_targets"), "credit": (Collector, "credit"),
                "gen_batch_size": (ChainConfig, "batch_size"), "gen_chunk": (Collector, "chunk"),
                "text_mas_context_length": (ChainConfig, "context_tokens")}
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for flat, (component, name) in mirrored.items():
        theirs = {f.name: f for f in dataclasses.fields(component)}[name]
        assert fields[flat].default == theirs.default
        assert meta(TrainConfig, flat)["help"] == theirs.metadata["help"]
        assert meta(TrainConfig, flat)["choices"] == theirs.metadata["choices"]
    assert meta(TrainConfig, "lora_targets")["choices"] == tuple(LORA_TARGETS)
    assert meta(TrainConfig, "credit")["choices"] == CREDITS
    assert meta(TrainConfig, "adapt_roles")["choices"] == ROLE_SETS


def test_key_refuses_a_missing_help_and_from_component_an_undocumented_field():
    with pytest.raises(TypeError):
        key(1, "")

    @dataclasses.dataclass
    class Bare:
        x: int = 1
    with pytest.raises(TypeError):
        from_component(Bare, "x")


def test_own_choices_are_checked_from_the_metadata():
    with pytest.raises(ValueError, match="adapt_roles='both': choose one of all, nonsink, middle"):
        TrainConfig(adapt_roles="both")
    with pytest.raises(ValueError, match="credit='x': choose one of shared, per_role"):
        TrainConfig(credit="x")
    TrainConfig(fit_prompt=None, report_to="tensorboard,wandb")   # none, and a tracker list, pass


def test_each_key_says_once_what_it_is_to_the_fingerprint():
    """The fingerprint is the declared "value" keys, pinned: a new key, a changed default or a
    changed role changes these digests, and this test says so."""
    from admm_dist.core.config_file import keys_by_fingerprint

    assert TrainConfig().fingerprint() == "d809cee5c0518f0c"
    assert TrainConfig(rho=0.1, compress="int8").fingerprint() == "76399467fa7153a0"
    assert train_config.RESUMABLE == ("eta", "grad_clip")
    assert keys_by_fingerprint(TrainConfig, "content") == ("fitset_cache", "init_state")
    assert set(keys_by_fingerprint(TrainConfig, "ignored")) == {
        "backend", "checkpoint_every", "dev_every", "device", "device_memory", "dry_run", "export_peft",
        "gen_batch_size", "k_outer", "keep_checkpoints", "max_delta_w_rel", "out", "overwrite", "plan_memory", "quiet",
        "report_dir", "report_to", "resume", "shard_backbone",
        "timeout_s", "tracking_dir", "vllm_gpu_memory_utilization", "vllm_kv_cache_gib", "vllm_max_model_len",
        "wandb_mode", "wandb_project"}
    base = TrainConfig().fingerprint()
    for changed in (dict(k_outer=3, out="elsewhere", gen_batch_size=2, vllm_kv_cache_gib=4.0),    # ignored
                    dict(fitset_cache="a.jsonl", init_state="b"),      # content: the trainer hashes the files
                    dict(eta=0.5, grad_clip=2.0)):                     # resumable: recorded, may change
        assert TrainConfig(**changed).fingerprint() == base, changed
    for changed in (dict(compress="int8"), dict(generation_backend="vllm"), dict(prefix_samples=2, credit="per_role"),
                    dict(recollect_anchors=4), dict(micro_batches=2), dict(dtype="bfloat16")):
        assert TrainConfig(**changed).fingerprint() != base, changed


# --------------------------------------------------------------------------- evaluate --config
def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_evaluate_takes_the_training_config_and_flags_override(tmp_path):
    path = write(tmp_path, "task: chain_arith\nmodel_name: " + STANDIN + "\nn_agents: 3\nprompt: sequential\n"
                 "fit_prompt: sequential_v2s\nthink: false\nadapt_roles: nonsink\nmax_new_tokens: 12\n"
                 "top_p: 0.9\ngen_batch_size: 7\nseed: 5\ndevice: cpu\ntemperature: 0.5\n")
    args = build_parser().parse_args(["--config", path, "--n", "2"])
    assert (args.task, args.model_name, args.n_agents, args.adapt_roles, args.max_new_tokens, args.top_p,
            args.batch_size, args.seed, args.device) == \
        ("chain_arith", STANDIN, 3, "nonsink", 12, 0.9, 7, 5, "cpu")
    assert args.prompt == "sequential_v2s"          # the deployment prompt
    assert args.temperature == 0.0                  # evaluation's own: greedy
    over = build_parser().parse_args(["--config", path, "--n_agents", "4", "--prompt", "hierarchical",
                                      "--seed", "7", "--adapt_roles", "all", "--think"])
    assert (over.n_agents, over.prompt, over.seed, over.adapt_roles, over.think) == (4, "hierarchical", 7, "all", True)
    _, _, _, chain, rows, settings = evaluation.prepare(args)   # everything before a backbone loads
    assert (chain.n_agents, chain.prompt, chain.max_new_tokens, len(rows)) == (3, "sequential_v2s", 12, 2)
    assert settings["config"] == path and settings["adapt_roles"] == "nonsink"


def test_evaluate_without_config_keeps_its_defaults():
    args = build_parser().parse_args(["--task", "chain_arith"])
    assert (args.model_name, args.adapt_roles, args.n_agents, args.prompt, args.seed, args.batch_size,
            args.generation_backend, args.device, args.think) == \
        (None, None, 4, "sequential_v2", 42, 64, "hf", "auto", False)


@pytest.mark.parametrize("text, expect", [
    ("task: fitset\n", "has task='fitset' (a pre-built fit set's label, not a task): pass --task NAME"),
    ("rhoo: 0.1\n", "did you mean 'rho'?): valid keys are listed by python -m admm_dist.train --help"),
    ("rho: abc\n", "is not a valid training config: rho='abc' must be a number"),
    ("- a\n", "must hold a mapping"),
])
def test_evaluate_refuses_a_bad_config_in_one_line(tmp_path, capsys, text, expect):
    from admm_dist.cli.evaluate import main
    assert main(["--config", write(tmp_path, text)]) == 2
    err = capsys.readouterr().err
    assert expect in err and err.count("\n") == 1 and err.startswith("admm-dist-evaluate: error: ")


def test_evaluate_with_a_fitset_config_and_task_given(tmp_path):
    args = build_parser().parse_args(["--config", write(tmp_path, "task: fitset\nn_agents: 2\n"),
                                      "--task", "chain_arith"])
    assert args.task == "chain_arith" and args.n_agents == 2 and args.model_name == "Qwen/Qwen3-8B"


def test_config_error_is_a_user_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("module", ["admm_dist.train", "admm_dist.evaluate"])
def test_help_into_a_pipe_closed_early_is_not_an_error(module):
    """``--help | head``: the reader stops after a few lines; no BrokenPipeError traceback."""
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-m", module, "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()                       # as head does, here before the first line is written
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and "Traceback" not in err, err
