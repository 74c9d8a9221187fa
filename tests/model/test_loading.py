"""Loading a backbone: its dtype is chosen in one function (backbone_dtype), from the device
unless the run names one, and a bad dtype is one line naming the choices."""
import os

import pytest
import torch

from admm_dist.core.errors import UserError
from admm_dist.model.loading import DTYPES, backbone_dtype, load_model

from conftest import REPO

TINY = os.path.join(str(REPO), "assets", "tiny", "backbone")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_bf16_on_cuda_and_fp32_on_cpu_and_a_named_dtype_is_taken_as_given():
    assert backbone_dtype(CPU) is torch.float32 and backbone_dtype(CUDA) is torch.bfloat16
    assert backbone_dtype(CPU, "bfloat16") is torch.bfloat16 and backbone_dtype(CUDA, "float32") is torch.float32
    assert DTYPES == ("auto", "float32", "bfloat16")
    with pytest.raises(UserError, match="dtype='float16': use one of auto, float32, bfloat16"):
        backbone_dtype(CPU, "float16")


def test_a_bfloat16_backbone_loads_in_bfloat16_on_cpu_and_gives_the_float32_ones_logits_to_round_off():
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    fp32, _ = load_model(TINY, CPU)
    bf16, _ = load_model(TINY, CPU, dtype="bfloat16")
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        a, b = fp32(input_ids=ids).logits, bf16(input_ids=ids).logits.float()
    assert not torch.equal(a, b) and float((a - b).abs().max()) < 0.1 * float(a.abs().max())
