"""GRPO's per-token objective (admm_dist.model.objectives.clipped_surrogate) against TRL's own:
on fixed sampling-policy and reference log-probs, advantages and masks, the loss and its gradient
with respect to B equal ``GRPOTrainer.compute_loss`` with ``loss_type="dapo"`` (TRL's default),
the same beta and clip epsilons, on the same PEFT model (TRL: a test dependency)."""
import pytest
import torch

from admm_dist.model import batches as B
from admm_dist.model import objectives as O

trl = pytest.importorskip("trl", reason="TRL is a test dependency: bash launch/install.sh test")

from conftest import REPO  # noqa: E402

ROWS, PROMPT, COMPLETION = 6, 5, 7
BETA, EPS_LOW, EPS_HIGH = 0.04, 0.2, 0.28


@pytest.fixture(scope="module", params=[BETA, 0.0], ids=["kl", "no-kl"])
def trainer_and_model(request, tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA

    path = str(REPO / "assets" / "tiny" / "backbone")
    ad = BOnlyLoRA(AutoModelForCausalLM.from_pretrained(path),
                   AdapterConfig(lora_rank=4, lora_alpha=8.0, lora_layers_last=2, lora_targets="attn_mlp"))
    g = torch.Generator().manual_seed(0)
    ad.load_vector(0.05 * torch.randn(ad.flat.shape, generator=g))   # B away from 0: a real gradient
    args = trl.GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=ROWS,
                          num_generations=2, beta=request.param, epsilon=EPS_LOW, epsilon_high=EPS_HIGH,
                          loss_type="dapo", report_to=[], use_cpu=True, max_completion_length=COMPLETION,
                          bf16=False)
    trainer = trl.GRPOTrainer(model=ad.model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, train_dataset=Dataset.from_dict({"prompt": ["a", "b", "c"]}),
                              processing_class=AutoTokenizer.from_pretrained(path))
    trainer.current_gradient_accumulation_steps = 1   # as TRL's training loop sets it, one step a batch
    return trainer, ad, request.param


def test_the_clipped_surrogate_is_trls_dapo_loss_and_gradient(trainer_and_model):
    trainer, ad, beta = trainer_and_model
    model = ad.model.eval()
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (ROWS, PROMPT), generator=g)
    completion = torch.randint(3, vocab, (ROWS, COMPLETION), generator=g)
    mask = torch.ones(ROWS, COMPLETION)
    mask[1, 4:] = 0
    mask[4, 2:] = 0                                            # completions of different lengths
    batch = B.Batch(input_ids=torch.cat([prompt, completion], 1),
                    attention_mask=torch.ones(ROWS, PROMPT + COMPLETION, dtype=torch.long),
                    target_ids=completion * mask.long(),
                    target_pos=PROMPT + torch.arange(COMPLETION).expand(ROWS, -1).contiguous(),
                    target_mask=mask, ref_logps=None, paired=False, example_index=list(range(ROWS)),
                    roles=["Solver"] * ROWS)
    with torch.no_grad():
        now = O.token_logps(model, batch)
    # the sampling policy and the reference some way off the current one, on both sides of the clip
    old = (now + 0.4 * torch.randn(now.shape, generator=g)) * mask
    ref = (now + 0.3 * torch.randn(now.shape, generator=g)) * mask
    adv = torch.tensor([1.2, -0.7, 0.0, 0.5, -1.5, 0.9])

    ad.flat_grad.zero_()
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
              "completion_mask": mask.long(), "advantages": adv, "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    theirs = trainer.compute_loss(model, inputs)
    theirs.backward()
    grad_theirs = ad.flat_grad.clone()

    ad.flat_grad.zero_()
    ours, metrics = O.clipped_surrogate(O.token_logps(model, batch), old, adv, mask, clip_low=EPS_LOW,
                                        clip_high=EPS_HIGH, ref=ref, kl_beta=beta)
    ours.backward()
    assert float(theirs) != 0 and grad_theirs.abs().sum() > 0
    assert torch.allclose(ours.detach(), theirs.detach(), rtol=1e-5, atol=0), (float(ours), float(theirs))
    assert float((ad.flat_grad - grad_theirs).norm()) <= 1e-5 * float(grad_theirs.norm())
    assert 0 < metrics["clip_frac"] < 1 and (("kl" in metrics) == (beta > 0))

