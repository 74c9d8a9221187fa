"""``generation_backend``: its settings are checked, and without vLLM installed the vllm
backend is one line naming the install command (the backend itself: tests/mas/test_vllm_backend.py)."""
import importlib.util

import pytest

from admm_dist.mas.collection import collect_key
from admm_dist.demo import standin
from admm_dist.training.config import TrainConfig

NO_VLLM = importlib.util.find_spec("vllm") is None


def test_hf_is_the_default_and_the_backend_keys_fingerprints_and_fit_sets():
    hf, vllm = TrainConfig(), TrainConfig(generation_backend="vllm")
    assert hf.generation_backend == "hf"
    assert collect_key(hf)["generation_backend"] == "hf" and collect_key(vllm)["generation_backend"] == "vllm"
    assert hf.fingerprint() != vllm.fingerprint()
    # engine sizing does not change what is computed
    assert vllm.fingerprint() == TrainConfig(generation_backend="vllm", vllm_kv_cache_gib=4.0).fingerprint()
    with pytest.raises(ValueError, match="choose one of hf, vllm"):
        TrainConfig(generation_backend="sglang")
    with pytest.raises(ValueError, match="vllm_kv_cache_gib"):
        TrainConfig(vllm_kv_cache_gib=0)


@pytest.mark.skipif(not NO_VLLM, reason="vLLM is installed here: the backend runs (tests/mas/test_vllm_backend.py)")
def test_without_vllm_both_commands_say_how_to_install_it(tmp_path, capsys):
    """Each command's own main in this process (the interpreter start-up is no part of it)."""
    from admm_dist.cli import evaluate, train

    rc = evaluate.main(["--task", "chain_arith", "--n", "2", "--model_name", str(standin.DEFAULT_DIR),
                        "--generation_backend", "vllm", "--max_new_tokens", "4"])
    ev_err = capsys.readouterr().err
    assert rc == 2 and len(ev_err.strip().splitlines()) == 1, ev_err
    assert "bash launch/vllm_env.sh" in ev_err
    rc = train.main(["task=chain_arith", "anchor_split=train", f"model_name={standin.DEFAULT_DIR}", "device=cpu",
                     "anchors=2", "group=2", "max_new_tokens=4", "lora_layers_last=1", "lora_rank=4", "k_outer=1",
                     "local_steps=1", "empty_nodes=prox", "generation_backend=vllm", f"out={tmp_path}/run",
                     f"report_dir={tmp_path}/rep"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2, err   # a VLLMBackendError is a UserError: exit code 2
    assert len(err) == 1 and "generation_backend=vllm needs vLLM" in err[0], err


def test_vllm_backend_errors_are_user_errors():
    from admm_dist.core.errors import UserError
    from admm_dist.mas.vllm_backend import VLLMBackendError

    assert issubclass(VLLMBackendError, UserError) and issubclass(VLLMBackendError, ValueError)
