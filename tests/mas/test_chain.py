"""The chain runtime: seeded sampling per row, continuation from a prefix, seat budgets,
and adapter states switched per seat (real tiny Qwen3, real PEFT adapter)."""
import math
import os

import pytest
import torch

from admm_dist.mas import ChainConfig, ChainRunner, row_seed
from admm_dist.mas.generate import RowSeededSampler, generate
from admm_dist.tasks.chain_arith import load_chain_arith

from conftest import REPO

ROOT = str(REPO)
TINY = os.path.join(ROOT, "assets", "tiny", "backbone")


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(TINY, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(TINY, local_files_only=True).eval()
    return model, tok


def _runner(tiny, **kw):
    model, tok = tiny
    cfg = dict(n_agents=4, words="compact", max_new_tokens=6, batch_size=8)
    cfg.update(kw)
    return ChainRunner(model, tok, ChainConfig(**cfg))


def test_sampler_draws_follow_softmax_and_respect_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]])
    n = 6000
    proc = RowSeededSampler(list(range(n)), temperature=0.8, top_p=1.0)
    picks = proc(None, logits.repeat(n, 1)).argmax(-1)
    freq = torch.bincount(picks, minlength=5).double() / n
    want = torch.softmax(logits[0].double() / 0.8, -1)
    assert torch.all((freq - want).abs() < 4 * torch.sqrt(want * (1 - want) / n) + 1e-3), (freq, want)
    # top-p 0.8: the nucleus is {0, 1} (p0 = 0.72 < 0.8 <= p0 + p1 = 0.92): nothing else is ever drawn
    proc = RowSeededSampler(list(range(n)), temperature=0.8, top_p=0.8)
    picks = proc(None, logits.repeat(n, 1)).argmax(-1)
    assert set(picks.tolist()) == {0, 1}
    # greedy rows (seed None) are left untouched
    out = RowSeededSampler([None, 3], 0.8, 0.95)(None, logits.repeat(2, 1))
    assert torch.equal(out[0], logits[0])


def _full_sort_sampler(gens, temperature, top_p, scores):
    """The definition the sampler must match: sort the whole vocabulary, drop a token when the
    mass before it reaches top_p, add each row's Gumbel noise."""
    s = scores.float() / temperature
    _, order = torch.sort(s, descending=True, dim=-1)
    probs = torch.softmax(s, dim=-1).gather(-1, order)
    drop = torch.zeros_like(s, dtype=torch.bool).scatter(-1, order, (probs.cumsum(-1) - probs) >= top_p)
    u = torch.stack([torch.rand(s.shape[-1], generator=g, dtype=torch.float64) for g in gens])
    return s.masked_fill(drop, float("-inf")) + (-torch.log(-torch.log(u.clamp_min(1e-300)))).float()


@pytest.mark.parametrize("temperature,top_p", [(0.3, 0.95), (0.8, 0.95), (1.5, 0.9), (0.8, 0.999)])
def test_sampler_nucleus_matches_a_full_sort_of_the_vocabulary(temperature, top_p):
    # a 3,000-token vocabulary: peaked rows find their nucleus in the top 256 logits, flat ones
    # (scale 0.1) reach past it and take the full sort; three steps draw the same streams
    gen = torch.Generator().manual_seed(0)
    seeds = list(range(100, 124))
    proc = RowSeededSampler(seeds, temperature, top_p)
    ref_gens = [torch.Generator().manual_seed(s) for s in seeds]
    assert RowSeededSampler.TOP_K < 3000
    for _ in range(3):
        scores = torch.randn(24, 3000, generator=gen) * torch.tensor([0.1, 1.0, 4.0, 12.0]).repeat(6)[:, None]
        got = proc(None, scores)
        assert torch.equal(got, _full_sort_sampler(ref_gens, temperature, top_p, scores))
    kept = (~torch.isinf(got)).sum(-1)
    assert kept.min() >= 1
    if top_p > 0.9:
        assert kept.max() > RowSeededSampler.TOP_K      # the full-sort path was taken too


def test_rows_do_not_depend_on_their_batch(tiny):
    model, tok = tiny
    prompts = [f"<|im_start|>user\nq{i}<|im_end|>\n<|im_start|>assistant\n" * (1 + i % 3) for i in range(6)]
    seeds = [row_seed(5, f"a{i}", 0, 0) for i in range(6)]
    together = generate(model, tok, prompts, seeds=seeds, max_new_tokens=8, batch_size=6)
    alone = [generate(model, tok, [p], seeds=[s], max_new_tokens=8)[0] for p, s in zip(prompts, seeds)]
    assert [g.text for g in together] == [g.text for g in alone]
    again = generate(model, tok, prompts[::-1], seeds=seeds[::-1], max_new_tokens=8, batch_size=4)
    assert [g.text for g in again][::-1] == [g.text for g in together]


def test_greedy_rows_match_plain_greedy_generate(tiny):
    model, tok = tiny
    prompt = "<|im_start|>user\nStart 3: +4<|im_end|>\n<|im_start|>assistant\n"
    ours = generate(model, tok, [prompt], seeds=[None], max_new_tokens=10)[0]
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    ref = model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    ids = ref[0, enc["input_ids"].shape[1]:].tolist()
    if tok.eos_token_id in ids:
        ids = ids[:ids.index(tok.eos_token_id)]
    assert ours.text == tok.decode(ids)


def test_same_seed_same_rollouts_and_seeds_matter(tiny):
    items = load_chain_arith("eval", n=3, seed=0)
    r = _runner(tiny)
    a = r.run(items, samples=2, seed=11)
    b = r.run(items, samples=2, seed=11)
    c = r.run(items, samples=2, seed=12)
    texts = lambda rs: [x.texts for row in rs for x in row]  # noqa: E731
    assert texts(a) == texts(b) and texts(a) != texts(c)
    assert all(len(x.texts) == 4 and len(x.prompts) == 4 for row in a for x in row)
    # the prompt of seat k carries seat k-1's message (sequential_v2, compact wording)
    x = a[0][0]
    assert f"\n{x.texts[0].strip()}\nCritic: step 2" in x.prompts[1]


def test_continue_from_a_prefix_keeps_it_and_reuses_seeds(tiny):
    items = load_chain_arith("eval", n=2, seed=0)
    r = _runner(tiny)
    full = r.run(items, samples=1, seed=3)
    prefix = [[full[i][0].texts[0], "999"] for i in range(2)]

    def seed_of(row, seat):
        return row_seed(3, items[row]["anchor"], 0, seat)
    cont = r.continue_chains(items, prefix, seed_of)
    for c, p in zip(cont, prefix):
        assert c.texts[:2] == p and len(c.texts) == 4
        assert "\n999\nRefiner: step 3" in c.prompts[2]
    # with the original history the continuation reproduces the original chain
    same = r.continue_chains(items, [full[i][0].texts[:2] for i in range(2)], seed_of)
    assert [c.texts for c in same] == [full[i][0].texts for i in range(2)]


def test_sink_budget_zero_means_the_last_seat_is_silent(tiny):
    items = load_chain_arith("eval", n=2, seed=0)
    out = _runner(tiny, sink_tokens=0).run(items, greedy=True)
    assert all(row[0].texts[-1] == "" and row[0].texts[0] for row in out)


def test_adapter_state_is_switched_per_seat(tiny):
    from transformers import AutoModelForCausalLM

    from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA

    model, tok = tiny
    fresh = AutoModelForCausalLM.from_pretrained(TINY, local_files_only=True).eval()
    adapter = BOnlyLoRA(fresh, AdapterConfig(lora_rank=4, lora_alpha=8.0, lora_layers_last=2,
                                              lora_basis_seed=0))
    big = torch.randn(adapter.numel, generator=torch.Generator().manual_seed(0)) * 3.0
    items = load_chain_arith("eval", n=4, seed=0)
    cfg = ChainConfig(n_agents=4, words="compact", max_new_tokens=6)
    base = ChainRunner(model, tok, cfg).run(items, greedy=True)
    tuned = ChainRunner(adapter.model, tok, cfg, adapter=adapter, seat_states={0: big}).run(items, greedy=True)
    seat0_same = [b[0].texts[0] == t[0].texts[0] for b, t in zip(base, tuned)]
    assert not all(seat0_same)  # seat 0 ran with its state
    # a seat without a state runs with the adapter off: given the same input it matches the base
    hist = [[b[0].texts[0]] for b in base]
    plain = ChainRunner(adapter.model, tok, cfg, adapter=adapter, seat_states={0: big})
    cont = plain.continue_chains(items, hist, lambda r, s: None)
    assert [c.texts for c in cont] == [b[0].texts for b in base]
    assert math.isfinite(float(adapter.vector().abs().sum()))


def test_think_reaches_the_chat_template_and_context_is_clipped_in_tokens(tiny):
    model, tok = tiny
    import copy
    tok = copy.deepcopy(tok)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}<|im_start|>assistant\n"
                         "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")
    item = load_chain_arith("eval", n=1, seed=0)[0]
    hist = ["first message", "second message"]
    off = ChainRunner(model, tok, ChainConfig(words="compact", think=False)).prompt_text(2, item, hist)
    on = ChainRunner(model, tok, ChainConfig(words="compact", think=True)).prompt_text(2, item, hist)
    assert off.endswith("<think>\n\n</think>\n\n") and on.endswith("assistant\n")
    clipped = ChainRunner(model, tok, ChainConfig(words="compact", context_tokens=10)).prompt_text(2, item, hist)
    assert "\nnd message\nRefiner: step 3" in clipped and "first" not in clipped   # the last 10 characters
    # upstream thinking stays private: only the text after </think> is carried
    carried = ChainRunner(model, tok, ChainConfig(words="compact")).prompt_text(
        1, item, ["<think>secret</think>7+1=8"])
    assert "secret" not in carried and "\n7+1=8\n" in carried


def test_think_needs_a_template_with_a_thinking_switch(tiny):
    model, tok = tiny      # the char tokenizer's template has no enable_thinking
    with pytest.raises(ValueError, match="no thinking switch .*use think=false"):
        ChainRunner(model, tok, ChainConfig(words="compact", think=True))
    ChainRunner(model, tok, ChainConfig(words="compact", think=False))
