"""Every YAML file in configs/ loads and validates; the config layering works as documented."""
import glob
import os

import pytest

from admm_dist.core import config_file as C
from admm_dist.training.config import TrainConfig

from conftest import REPO

ROOT = str(REPO)
FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True))


def test_there_are_configs_for_every_arm():
    names = {os.path.relpath(f, os.path.join(ROOT, "configs")) for f in FILES}
    for arm in ("admm_ring", "admm_gossip", "centralized", "admm_local", "admm_nodual"):
        assert f"{arm}.yaml" in names and f"cpu/{arm}.yaml" in names


@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.relpath(p, ROOT))
def test_config_file_loads_and_validates(path):
    cfg = C.load(TrainConfig, ["--config", path])
    assert cfg.n_nodes() >= 1
    if "/cpu/" in path:  # the small CPU runs use files shipped in the repository or built offline
        from admm_dist.model.pretrained import MODELS
        built = {p.folder for p in MODELS.values()}       # python -m admm_dist.cli.pretrained NAME builds them
        assert cfg.model_name in built or os.path.isdir(os.path.join(ROOT, cfg.model_name))
        if cfg.fitset_cache:   # the shipped fit set reads under this code's format and fits the run
            from admm_dist.data.fitset import load_fitset
            from admm_dist.training.pipeline import collect_settings

            shipped = load_fitset(os.path.join(ROOT, cfg.fitset_cache))
            assert shipped.examples and shipped.settings == collect_settings(cfg)
        else:   # collects on-policy: the task must be registered and generated locally
            from admm_dist import tasks
            assert tasks.get(cfg.task).name == cfg.task and cfg.task_path is None
    else:  # the paper's settings (Table A2)
        assert (cfg.rho, cfg.local_steps, cfg.eta, cfg.grad_clip, cfg.batch_size) == (0.03, 16, 1e-3, 0.01, 8)
        assert (cfg.lora_rank, cfg.lora_layers_last, cfg.lora_targets) == (16, 36, "attn_mlp")


def test_defaults_then_yaml_then_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("rho: 0.5\nk_outer: 7\n")
    cfg = C.load(TrainConfig, ["--config", str(y), "--rho", "0.2", "local_steps=3", "--no_dual"])
    assert (cfg.rho, cfg.k_outer, cfg.local_steps, cfg.no_dual, cfg.eta) == (0.2, 7, 3, True, 1e-3)
    assert "rho: 0.2" in C.dump_yaml(cfg)


@pytest.mark.parametrize("argv,match", [
    (["--rhoo", "1"], "did you mean 'rho'"),
    (["k_outer=two"], "must be an integer"),
    (["--consensus", "star"], "choose one of"),
    (["--dev_frac", "1.5"], r"\[0, 1\)"),
    (["--local_only", "--no_dual"], "choose one"),
    (["stray"], "--key value or key=value"),
    (["generation_backend=sglang"], "choose one of hf, vllm"),
    (["vllm_gpu_memory_utilization=1.5"], r"in \(0, 1\)"),
])
def test_bad_values_and_unknown_keys_are_clear_errors(argv, match):
    with pytest.raises(ValueError, match=match):
        C.load(TrainConfig, argv)


def test_unknown_yaml_key_is_rejected(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("local_step: 3\n")
    with pytest.raises(C.ConfigError, match="did you mean 'local_steps'"):
        C.load(TrainConfig, ["--config", str(y)])
    with pytest.raises(C.ConfigError, match="does not exist"):
        C.load(TrainConfig, ["--config", str(tmp_path / "nope.yaml")])
    # a second file would silently replace the first: refused, naming the fix
    with pytest.raises(C.ConfigError, match="--config given twice.*key=value"):
        C.load(TrainConfig, ["--config", "configs/cpu/admm_ring.yaml", "--config=configs/cpu/admm_local.yaml"])


def test_a_yaml_list_for_report_to_names_the_comma_form(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("report_to: [tensorboard, wandb]\n")
    with pytest.raises(C.ConfigError, match="report_to must be a string, got a list: write it as one string, "
                                            "e.g. report_to=tensorboard,wandb"):
        C.load(TrainConfig, ["--config", str(y)])
    y.write_text("report_to: tensorboard,wandb\n")
    assert C.load(TrainConfig, ["--config", str(y)]).tracking_config().active == ["tensorboard", "wandb"]


@pytest.mark.parametrize("argv,match", [
    (["out="], "name the run"),
    (["out=runs/."], "name the run"),
    (["dev_frac=1.5"], "dev_frac=1.5: use a number in \\[0, 1\\) \\(default 0.0\\)"),
    (["overwrite=true", "resume=auto"], "choose one"),
    (["max_delta_w_rel=0"], "max_delta_w_rel"),
])
def test_output_settings_are_checked(argv, match):
    with pytest.raises(ValueError, match=match):
        C.load(TrainConfig, argv)
    assert C.load(TrainConfig, ["out=runs/x///"]).out == os.path.realpath("runs/x")   # the real path: its identity
