"""Bad YAML config files are one ConfigError line naming the path and the fix (issue 21): a folder
or a binary file, a syntax error (line and column), a duplicate key, a null for a key that needs a
value; a device outside auto, cpu, cuda, cuda:N is refused when the config is checked. Real files,
real loader; nothing is mocked."""
import glob
import os

import pytest
import yaml

from admm_dist.core import config_file as C
from admm_dist.core.errors import UserError
from admm_dist.training.config import TrainConfig

from conftest import REPO

CONFIGS = sorted(glob.glob(os.path.join(str(REPO), "configs", "**", "*.yaml"), recursive=True))


def load(*argv):
    return C.load(TrainConfig, list(argv))


def one_line_error(*argv) -> str:
    with pytest.raises(UserError) as info:
        load(*argv)
    msg = str(info.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def error_lines(err: str):
    """The command's error lines; no traceback (other diagnostics on stderr are not counted)."""
    assert "Traceback" not in err, err
    return [ln for ln in err.splitlines() if "error" in ln.lower()]


# ------------------------------------------------------------------ 1. a folder or a binary file
@pytest.mark.parametrize("content, what", [
    (bytes(range(256)), "a NUL byte at offset 0"),              # binary with NUL bytes
    (b"\x89PNG\r\n\x1a\n" + b"\xff" * 16, "byte 0x89 at offset 0 is not UTF-8"),   # no NUL, not UTF-8
    (b"rho: 0.1\nk_outer: \x07\n", "control character #x0007 at line 2, column 10"),
])
def test_a_binary_file_as_config_is_one_line_naming_it(tmp_path, content, what):
    path = tmp_path / "model.bin"
    path.write_bytes(content)
    msg = one_line_error("--config", str(path))
    assert msg == (f"config file {path} is not a text file ({what}): give a YAML file to --config, "
                   "e.g. --config configs/cpu/admm_ring.yaml")


def test_a_folder_as_config_is_one_line_naming_it(tmp_path):
    msg = one_line_error("--config", str(tmp_path))
    assert msg == (f"config file {tmp_path} is a folder: give a YAML file to --config, "
                   "e.g. --config configs/cpu/admm_ring.yaml")


def test_the_train_command_prints_the_one_line(tmp_path, capsys):
    from admm_dist.cli.train import main
    assert main(["--config", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and error_lines(err) == [
        f"admm_dist.train: error: config file {tmp_path} is a folder: give a YAML file to --config, "
        "e.g. --config configs/cpu/admm_ring.yaml"]


# ------------------------------------------------------------------ 2. syntax errors: line and column
@pytest.mark.parametrize("text, where, problem", [
    ("rho: 0.1\nk_outer: 3\n  local_steps: 2\n", "line 3, column 14", "mapping values are not allowed here"),
    ("rho: 0.1\nout: 'runs/x\n", "line 3, column 1", "found unexpected end of stream"),
    ("rho: 0.1\n- k_outer\n", "line 2, column 1", "expected <block end>, but found '-'"),
])
def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path, text, where, problem):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert one_line_error("--config", str(path)) == \
        f"{path} is not valid YAML at {where}: {problem}: fix the file there"


# ------------------------------------------------------------------ 3. duplicate keys
def test_a_duplicate_key_is_refused_naming_key_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rho: 0.1\nk_outer: 3\n# a comment\nrho: 0.2\n")
    assert one_line_error("--config", str(path)) == \
        f"{path}: line 4: key 'rho' is given twice (first on line 1): keep one of them"
    # in a nested mapping too (a value that is itself a mapping is then refused as a type)
    path.write_text("report_to:\n  a: 1\n  a: 2\n")
    assert "line 3: key 'a' is given twice (first on line 2)" in one_line_error("--config", str(path))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.relpath(p, str(REPO)))
def test_valid_files_load_as_pyyaml_loads_them(path):
    with open(path) as fh:
        assert C.load_yaml(path) == yaml.safe_load(fh)


def test_a_merge_key_may_still_be_overridden(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nrun:\n  <<: *b\n  y: 3\n")
    assert C.load_yaml(str(path)) == {"base": {"x": 1, "y": 2}, "run": {"x": 1, "y": 3}}


# ------------------------------------------------------------------ 4. a YAML null for a key with a value
@pytest.mark.parametrize("line, key, default", [
    ("out:", "out", "runs/admm"),
    ("out: ~", "out", "runs/admm"),
    ("report_dir: null", "report_dir", "results"),
    ("k_outer:", "k_outer", "20"),
    ("eta:", "eta", "0.001"),
    ("quiet:", "quiet", "false"),
])
def test_a_yaml_null_for_a_key_that_needs_a_value_is_refused(tmp_path, line, key, default):
    path = tmp_path / "c.yaml"
    path.write_text(f"rho: 0.1\n{line}\n")
    assert one_line_error("--config", str(path)) == \
        f"{key} is empty (null) in {path}: give it a value, or delete the line to keep the default {default}"


def test_a_yaml_null_for_an_optional_key_is_still_none(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("task_path:\nlora_basis_seed: null\nout: runs/x\n")
    cfg = load("--config", str(path))
    assert cfg.task_path is None and cfg.lora_basis_seed is None and cfg.out == os.path.realpath("runs/x")


# ------------------------------------------------------------------ 5. the device
@pytest.mark.parametrize("device", ["tpu", "cuda:x", "CUDA", "cuda:", "mps", "cpu:0"])
def test_an_unknown_device_is_refused_at_config_validation(tmp_path, device):
    assert one_line_error(f"device={device}") == \
        f"device={device!r} is not supported: use auto, cpu, cuda or cuda:N (e.g. device=cuda:0)"
    path = tmp_path / "c.yaml"
    path.write_text(f"device: '{device}'\n")
    assert one_line_error("--config", str(path)).startswith(f"device={device!r} is not supported")


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_the_accepted_device_forms_validate_without_a_gpu(device):
    assert load(f"device={device}").device == device


def test_the_device_help_names_the_accepted_forms():
    from admm_dist.training.config import help_text
    assert C.meta(TrainConfig, "device")["help"].startswith("auto, cpu, cuda or cuda:N")
    assert "--device DEVICE" in help_text()


def test_the_train_command_refuses_device_tpu_in_one_line(tmp_path, capsys):
    from admm_dist.cli.train import main
    rc = main(["device=tpu", f"out={tmp_path / 'run'}", f"report_dir={tmp_path / 'rep'}"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and error_lines(err) == [
        "admm_dist.train: error: device='tpu' is not supported: use auto, cpu, cuda or cuda:N (e.g. device=cuda:0)"]
    assert not os.path.exists(tmp_path / "run")


# ------------------------------------------------------------------ 6. ceilings of a config file (issue 40)
BOMB = ("k_outer: [&a [1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b], "
        "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,*e,*e,*e], "
        "&g [*f,*f,*f,*f,*f,*f,*f,*f,*f], &h [*g,*g,*g,*g,*g,*g,*g,*g,*g], &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]]\n")


@pytest.mark.parametrize("text", [BOMB, "rho: 0.1\nk_outer: &a [*a]\n"], ids=["bomb", "recursive"])
def test_an_alias_bomb_is_refused_in_one_line_without_being_built(tmp_path, text):
    """Nine aliases nine deep in a valid key took 3.6 GB, then a MemoryError traceback."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert one_line_error("--config", str(path)) == (
        f"{path} holds more than 10000 values once its aliases (*name) are expanded, the ceiling of a config "
        "file (MAX_CONFIG_NODES): a config is flat key: value pairs; write each value once")


def test_nesting_past_its_ceiling_is_refused_naming_the_line(tmp_path):
    """5000 levels were a RecursionError traceback; 32 still load."""
    path = tmp_path / "c.yaml"
    path.write_text("rho: 0.1\nreport_to: " + "[" * 5000 + "]" * 5000 + "\n")
    assert one_line_error("--config", str(path)) == (
        f"{path}: line 2: nested deeper than 32 levels, the ceiling of a config file (MAX_CONFIG_DEPTH): a config "
        "is flat key: value pairs; flatten the value")
    path.write_text("x: " + "[" * 31 + "]" * 31 + "\n")
    assert C.load_yaml(str(path)) == yaml.safe_load(path.read_text())


def test_a_config_file_over_its_size_ceiling_is_refused_unread(tmp_path):
    from admm_dist.core.constants import MAX_CONFIG_BYTES
    path = tmp_path / "c.yaml"
    path.write_text("rho: 0.1\n" + "#" * MAX_CONFIG_BYTES + "\n")
    assert one_line_error("--config", str(path)) == (
        f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes, the ceiling of a config file "
        "(MAX_CONFIG_BYTES): give a YAML file of key: value lines, e.g. --config configs/cpu/admm_ring.yaml")


def test_a_numbers_range_is_said_once_at_its_key_and_refused_in_one_line():
    import dataclasses
    from typing import Optional

    @dataclasses.dataclass
    class Part:
        steps: int = C.key(4, "steps", at_least=1, at_most=10)
        share: float = C.key(0.5, "share", above=0, below=1)
        cap: Optional[int] = C.key(None, "cap", at_least=0)
        free: float = 1.0

        def __post_init__(self):
            C.check_bounds(self)

    Part(cap=0, free=-1.0)                                   # in range; None and unbounded fields unchecked
    for kw, said in [(dict(steps=0), "steps=0: use an integer >= 1 (default 4)"),
                     (dict(steps=True), "steps=True: use an integer >= 1 (default 4)"),
                     (dict(steps=11), "steps=11 exceeds the ceiling 10: use at most 10"),
                     (dict(share=1.0), "share=1.0: use a number in (0, 1) (default 0.5)"),
                     (dict(share=float("nan")), "share=nan: use a number in (0, 1) (default 0.5)"),
                     (dict(cap=-1), "cap=-1: use an integer >= 0 (default none)")]:
        with pytest.raises(C.ConfigError) as e:
            Part(**kw)
        assert str(e.value) == said
    # --help shows the range beside the default; a key takes one kind of floor
    from admm_dist.training.config import GROUPS
    shown = " ".join(C.format_help(TrainConfig, GROUPS).split())
    assert "(lambda = 1/rho) >= 0; default: 0.03" in shown and "clip_eps in (0, 1); default: 0.2" in shown
    with pytest.raises(TypeError, match="at_least or above"):
        C.key(1, "x", at_least=0, above=0)
