"""The chain runtime: ``n_agents`` seats on one backbone, each with its own adapter state.

``ChainRunner`` rolls out the multi-agent system seat by seat, batched across queries and
samples: for seat k it builds every row's prompt (:mod:`admm_dist.mas.prompts`, through the
tokenizer's chat template), switches the adapter to seat k's state (a copy into the flat B
vector, no weight reload; seats without a state run with the adapter off), and generates.

Seeds: every (query, sample, seat) draws from its own stream, ``row_seed(seed, anchor,
sample, seat)``, so the same seed gives the same rollouts whatever the batching, and a
chain can be continued from any prefix (``continue_chains``) with chosen seeds: that is
how ``credit per_role`` branches one seat and finishes downstream with ``downstream_seed``,
and how ``standin check`` measures a seat's influence.

``seat_models`` (from ``agent_models``) runs a given seat on another backbone, e.g. a
compromised agent.

``generator`` (``generation_backend vllm``) generates instead of ``model.generate``: a
:class:`admm_dist.mas.vllm_backend.VLLMBackend` holding the frozen backbone, given the
seat's state (its B vector, served as that seat's LoRA adapter) with every call. Seats
on ``seat_models`` still generate with transformers.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from admm_dist.core import progress
from admm_dist.core.config_file import check_bounds, key
from admm_dist.core.constants import MAX_AGENTS, MAX_GEN_BATCH, MAX_TOKENS
from admm_dist.core.errors import UserError
from admm_dist.mas import prompts as P
from admm_dist.mas.generate import generate
from admm_dist.tasks.scoring import visible

SeedFn = Callable[[int, int], Optional[int]]   # (row, seat) -> seed, None = greedy


def row_seed(seed: int, anchor: str, sample: int, seat: int) -> int:
    """The sampling seed of one seat in one chain (63-bit, stable across processes)."""
    h = hashlib.sha256(f"{seed}|{anchor}|{sample}|{seat}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


@dataclasses.dataclass
class Rollout:
    """One chain on one query: every seat's prompt and message."""
    item: dict
    sample: int
    prompts: List[str]
    texts: List[str]
    finished: List[bool]
    n_tokens: List[int] = dataclasses.field(default_factory=list)   # generated per seat (0: given)

    @property
    def final_text(self) -> str:
        return self.texts[-1] if self.texts else ""


@dataclasses.dataclass
class ChainConfig:
    # no role or prompt limits a chain (seats past the Judger are Agent5, ...): MAX_AGENTS is a ceiling
    n_agents: int = key(4, "seats in the chain (roles Planner, Critic, Refiner, Judger, then Agent5, ...)",
                        at_least=1, at_most=MAX_AGENTS)
    prompt: str = key("sequential_v2", "prompt layout: sequential (a seat reads the previous message), "
                      "sequential_v2 (every upstream message), hierarchical (seats answer alone, the last "
                      "reads them all); *_v2s: hardened (other agents' messages are quoted as data)",
                      choices=P.prompt_modes())
    words: str = key("default", "the task's prompt wording", choices=P.WORDINGS)
    think: bool = key(False, "turn on the chat template's thinking mode (needs an enable_thinking switch)")
    context_tokens: Optional[int] = key(None, "cap on the upstream context a seat reads, in tokens "
                                        "(none or 0: no cap)")
    max_new_tokens: int = key(4096, "token budget of each generated message", at_least=1, at_most=MAX_TOKENS)
    sink_tokens: Optional[int] = key(None, "the last seat's budget in training rollouts (none: "
                                     "max_new_tokens; 0: it does not generate)", at_least=0,
                                     at_most=MAX_TOKENS)
    temperature: float = key(0.8, "sampling temperature of on-policy rollouts (> 0)")
    top_p: float = key(0.95, "nucleus sampling: keep the smallest token set of this probability, in (0, 1]")
    batch_size: int = key(64, "rows per generate call (memory only: results do not change)",
                          at_least=1, at_most=MAX_GEN_BATCH, fingerprint="ignored")

    def __post_init__(self) -> None:
        check_bounds(self)
        P.mode_of(self.prompt)
        P.wording(self.words)
        if self.context_tokens is not None and self.context_tokens <= 0:
            self.context_tokens = None

    def budget(self, seat: int) -> int:
        if seat == self.n_agents - 1 and self.sink_tokens is not None:
            return self.sink_tokens
        return self.max_new_tokens


def check_think(tokenizer, think: bool) -> None:
    """``think=True`` needs a chat template with a thinking switch (``enable_thinking``)."""
    if not think:
        return
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = (" ".join(map(str, dict(template).values())) if isinstance(template, dict)
                    else str(template))
    if "enable_thinking" not in template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise UserError(f"think=true: the chat template of {name} has no thinking switch "
                        "(enable_thinking): use think=false with this model")


class ChainRunner:
    """Roll out the chain. ``adapter`` is a BOnlyLoRA on ``model`` (or None); ``seat_states``
    maps a seat to the B vector it runs with; ``seat_models`` maps a seat to another
    (model, tokenizer). ``progress``: a bar with this label over the messages generated
    (:mod:`admm_dist.core.progress`: drawn only on a terminal)."""

    def __init__(self, model, tokenizer, config: ChainConfig, *, adapter=None,
                 seat_states: Optional[Dict[int, torch.Tensor]] = None,
                 seat_models: Optional[Dict[int, Tuple[object, object]]] = None,
                 generator=None, progress: Optional[str] = None):
        if adapter is not None and model is not adapter.model:
            raise ValueError("with an adapter, run the chain on adapter.model (the wrapped backbone)")
        self.model, self.tok, self.cfg = model, tokenizer, config
        self.adapter = adapter
        self.seat_states = dict(seat_states or {})
        self.seat_models = dict(seat_models or {})
        self.generator = generator
        self.progress = progress
        check_think(tokenizer, config.think)
        for _, seat_tok in self.seat_models.values():
            check_think(seat_tok, config.think)
        if self.seat_states and adapter is None:
            raise ValueError("seat_states need an adapter to load them into")
        bad = [s for s in list(self.seat_states) + list(self.seat_models) if not 0 <= s < config.n_agents]
        if bad:
            raise UserError(f"seats {bad} are outside a chain of {config.n_agents} seats")

    # ------------------------------------------------------------------ prompts
    def _clip(self, tok) -> Optional[Callable[[str], str]]:
        t = self.cfg.context_tokens
        if t is None:
            return None
        return lambda s: tok.decode(tok(s, add_special_tokens=False)["input_ids"][-t:])

    def prompt_text(self, seat: int, item: dict, history: Sequence[str], *,
                    mode: Optional[str] = None, tokenizer=None) -> str:
        """Seat ``seat``'s chat-formatted prompt given the upstream messages ``history``."""
        tok = tokenizer or self.seat_models.get(seat, (None, self.tok))[1]
        content = P.user_message(mode or self.cfg.prompt, seat=seat, n_agents=self.cfg.n_agents,
                                 question=str(item["question"]),
                                 history=[visible(h) for h in history[:seat]],
                                 answer_type=str(item.get("answer_type", "number")),
                                 words=self.cfg.words, clip=self._clip(tok))
        return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=self.cfg.think)

    # ------------------------------------------------------------------ rollouts
    def run(self, items: Sequence[dict], *, samples: int = 1, seed: int = 0,
            greedy: bool = False) -> List[List[Rollout]]:
        """``samples`` chains per item from scratch: result[i][s]."""
        rows = [(it, s) for it in items for s in range(samples)]
        seed_of: SeedFn = (lambda r, seat: None) if greedy else (
            lambda r, seat: row_seed(seed, str(rows[r][0]["anchor"]), rows[r][1], seat))
        flat = self.continue_chains([it for it, _ in rows], [[] for _ in rows], seed_of,
                                    samples=[s for _, s in rows])
        return [flat[i * samples:(i + 1) * samples] for i in range(len(items))]

    def continue_chains(self, items: Sequence[dict], histories: Sequence[Sequence[str]],
                        seed_of: SeedFn, *, samples: Optional[Sequence[int]] = None) -> List[Rollout]:
        """Finish each chain from its given prefix of messages (row r starts at seat
        len(histories[r])); ``seed_of(r, seat)`` picks each generated message's seed."""
        n = self.cfg.n_agents
        if len(items) != len(histories):
            raise ValueError(f"{len(items)} items but {len(histories)} histories")
        texts = [list(h) for h in histories]
        if any(len(t) > n for t in texts):
            raise ValueError(f"a history is longer than the chain's {n} seats")
        prompts: List[List[str]] = [[""] * len(t) for t in texts]
        finished: List[List[bool]] = [[True] * len(t) for t in texts]
        n_tokens: List[List[int]] = [[0] * len(t) for t in texts]
        start = min((len(t) for t in texts), default=n)
        todo = sum(n - len(t) for t in texts)
        with progress.bar(total=todo, desc=self.progress or "", unit="msg",
                          show=bool(self.progress)) as shown:
            for seat in range(start, n):
                self._seat(seat, items, texts, prompts, finished, n_tokens, seed_of, shown.update)
        samples = samples if samples is not None else [0] * len(items)
        return [Rollout(items[r], samples[r], prompts[r], texts[r], finished[r], n_tokens[r])
                for r in range(len(items))]

    def _seat(self, seat: int, items, texts, prompts, finished, n_tokens, seed_of: SeedFn,
              on_batch: Callable[[int], None]) -> None:
        """Generate seat ``seat``'s message for every row whose chain has reached it."""
        rows = [r for r, t in enumerate(texts) if len(t) == seat]
        if not rows:
            return
        model, tok = self.seat_models.get(seat, (self.model, self.tok))
        ptexts = [self.prompt_text(seat, items[r], texts[r], tokenizer=tok) for r in rows]
        seeds = [seed_of(r, seat) for r in rows]
        if self.generator is not None and seat not in self.seat_models:
            gens = self.generator.generate(ptexts, seeds=seeds, max_new_tokens=self.cfg.budget(seat),
                                           temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                           state=self.seat_states.get(seat))
            on_batch(len(rows))
        else:
            with self.seat_context(seat, model):
                gens = generate(model, tok, ptexts, seeds=seeds, max_new_tokens=self.cfg.budget(seat),
                                temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                batch_size=self.cfg.batch_size, on_batch=on_batch)
        for r, p, g in zip(rows, ptexts, gens):
            texts[r].append(g.text)
            prompts[r].append(p)
            finished[r].append(g.finished)
            n_tokens[r].append(g.n_tokens)

    # ------------------------------------------------------------------ adapters
    def seat_context(self, seat: int, model):
        """Run ``model`` as seat ``seat``: its adapter state loaded, or the adapter off."""
        import contextlib

        if self.adapter is None or model is not self.model:
            return contextlib.nullcontext()
        state = self.seat_states.get(seat)
        if state is None:
            return self.adapter.disabled()
        self.adapter.load_vector(state)
        return contextlib.nullcontext()
