"""On-policy collection: the MAS rolls out training queries; its messages become fit sets.

For each query the chain is sampled ``group`` times under the current adapters, and every
adapted seat's message becomes an ``sft`` example labelled with the outcome (docs/design.md
section 4). The trainer derives ``dpo``/``rsft`` from it (:func:`admm_dist.data.derive.derive`).

- ``credit shared``: ``group`` whole chains; every message of a chain is credited with the
  chain's outcome. DPO pairs a seat's message from a successful chain with one from a failed
  chain of the same query (their prompts may differ: ``rejected_prompt``).
- ``credit per_role``: one prefix chain per query (seed ``seed``); for each adapted seat k,
  ``group`` branches sample seat k's message from that fixed prefix and finish the chain
  with ``downstream_seed`` (the same for every branch), so a difference in outcome belongs
  to seat k's message. DPO pairs share seat k's prompt. With ``prefix_samples`` P > 1 the
  prefix is the first of P sampled chains that answered right (the first chain when none
  did): branching from a prefix whose upstream messages are already wrong rewards only the
  downstream messages that happen to cancel the error, which teaches wrong steps.
- ``reward outcome``: the task's scorer on the final message (1 or 0). ``gold_likelihood``:
  the mean log-probability of the gold answer as the last seat's reply after the chain;
  a message succeeds when its chain's likelihood beats the query's mean.
- Filters: ``anchor_pool`` pre-screens candidates with two sampled chains each and drops
  those answered right both times; ``anchor_pass_band LO,HI`` keeps queries whose pass rate
  lies strictly inside (LO, HI).

:func:`collect_fitset` is the trainer's whole step (queries, pre-screen, rollouts, filter).
Work is split in chunks of ``gen_chunk`` queries; chunk c runs on rank c mod world and the
results are all-gathered (JSON over every rank, metered as telemetry), so every rank ends
with the same fit set as one process would build, and keeps its own seats' examples.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from admm_dist import tasks
from admm_dist.core import progress
from admm_dist.core.config_file import check_bounds, key
from admm_dist.core.constants import PRESCREEN_SALT
from admm_dist.core.errors import UserError
from admm_dist.data import queries
from admm_dist.data.derive import advantages
from admm_dist.data.fitset import Example, FitSet
from admm_dist.engine.comm import TELEMETRY
from admm_dist.engine.comm.communicator import wait_all
from admm_dist.mas import ChainRunner, row_seed
from admm_dist.mas.generate import end_of_turn_text
from admm_dist.mas.prompts import role_name
from admm_dist.model.loading import load_model

COLLECT_KEY = ("task", "prompt", "think", "n_agents", "adapt_roles", "credit", "reward",
               "fit_mode", "anchors", "group", "seed", "downstream_seed", "sink_tokens",
               "max_new_tokens", "temperature", "top_p", "anchor_split", "anchor_pass_band",
               "anchor_pool", "anchor_offset", "task_path", "n_ops", "text_mas_context_length",
               "fit_prompt", "agent_models", "prefix_samples", "generation_backend", "dtype")
CREDITS = ("shared", "per_role")                 # credit: one reward for the chain, or per seat
REWARDS = ("outcome", "judge", "gold_likelihood")  # reward: what scores a rollout


def collect_key(cfg, *, init_sha: str = "none", collection: int = 0) -> Dict[str, Any]:
    """The settings a collected fit set is keyed by (a cache built otherwise is refused)."""
    key = {k: getattr(cfg, k) for k in COLLECT_KEY}
    # targets: a message keeps the end-of-turn token it ended with (Collector._example); a cache
    # collected before that rule lacks the entry and is refused, naming the fix
    key.update(init_sha=init_sha, collection=collection, sampling_structure="on_policy",
               targets="end_of_turn")
    return key


Exchange = Callable[[Any], List[Any]]    # this rank's JSON-able result -> every rank's, in rank order


def gather_json(comm, device, timeout: datetime.timedelta) -> Exchange:
    """An Exchange over every rank of the default process group: one JSON object per rank, in
    rank order, as a length then padded bytes (no pickle); the bytes are metered as telemetry
    on this rank's first node; every wait is bounded by ``timeout``. Every rank collects its
    own chunks, the k ranks of a seat too."""
    world, rank = dist.get_world_size(), dist.get_rank()

    def gather(t: torch.Tensor) -> List[torch.Tensor]:
        every = [torch.empty_like(t) for _ in range(world)]
        wait_all([dist.all_gather(every, t, async_op=True)], timeout, "the collection's exchange", rank)
        return every

    def exchange(obj: Any) -> List[Any]:
        if world == 1:
            return [obj]
        data = json.dumps(obj, sort_keys=True).encode()
        sizes = [int(n) for n in gather(torch.tensor([len(data)], dtype=torch.int64, device=device))]
        buf = torch.zeros(max(max(sizes), 1), dtype=torch.uint8, device=device)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        comm.meter.add(comm.nodes[0], "all_gather", sent=buf.numel() * (world - 1),
                       recv=buf.numel() * (world - 1), phase=TELEMETRY)
        return [json.loads(b[:n].cpu().numpy().tobytes().decode()) for b, n in zip(gather(buf), sizes)]
    return exchange


@dataclasses.dataclass
class Collector:
    """Collects with ``runner`` (its adapter states are set by the caller) for ``task``."""
    runner: ChainRunner
    task: str
    seats: Sequence[int]                 # adapted seats: the ones that get examples
    group: int = key(8, "rollouts per training query (per adapted seat under per_role credit)", at_least=1)
    credit: str = key("shared", "shared: every message of a chain gets the chain's outcome; per_role: each "
                      "adapted seat resamples its message from one fixed prefix and the chain is finished "
                      "with downstream_seed, so an outcome difference belongs to that seat", choices=CREDITS)
    reward: str = key("outcome", "what scores a rollout: outcome (the task's scorer on the final answer), "
                      "judge (safety labels stored in the fit set by judge_fitset), gold_likelihood "
                      "(log-prob of the gold answer after the chain)", choices=REWARDS)
    seed: int = 42
    downstream_seed: int = key(1234, "per_role: the sampling seed of the seats after the branching one")
    chunk: int = key(8, "queries per collection work unit; units are spread over the ranks", at_least=1)
    prefix_samples: int = key(1, "per_role: branch from the first of this many prefix chains that answered "
                              "right (the first chain when none did)", at_least=1)
    fit_prompt: Optional[str] = None
    rank: int = 0
    world: int = 1
    progress: Optional[str] = None       # a bar with this label over this rank's chunks
    exchange: Optional[Exchange] = None

    def __post_init__(self) -> None:
        if self.reward == "judge":
            raise UserError("reward judge labels stored trajectories: build the fit set with "
                            "admm_dist.cli.build_fitset and judge_fitset, then pass --fitset_cache")
        check_bounds(self)
        if self.prefix_samples > 1 and self.credit != "per_role":
            raise UserError("prefix_samples picks the prefix that per_role credit branches from: "
                            "use it with --credit per_role, or drop it")
        if self.prefix_samples > 1 and tasks.get(self.task).answer_type == "safety":
            raise UserError("prefix_samples keeps a prefix that answered right, which a safety task "
                            "cannot score without a judge: drop --prefix_samples")
        if self.world > 1 and self.exchange is None:
            raise UserError("a collection over several ranks needs an exchange (collect.gather_json)")
        # each seat's end-of-turn text, read once (a fast tokenizer builds its whole vocabulary per lookup)
        self._end_of_turn = {
            seat: end_of_turn_text(self.runner.seat_models.get(seat, (None, self.runner.tok))[1])
            for seat in self.seats}

    # ------------------------------------------------------------------ work split
    def _map(self, items: Sequence[dict], fn: Callable[[List[dict]], List[Any]]) -> List[Any]:
        """fn over chunks of items; chunk c on rank c % world; results in item order everywhere."""
        chunks = [list(items[i:i + self.chunk]) for i in range(0, len(items), self.chunk)]
        own = [c for c in range(len(chunks)) if c % self.world == self.rank]
        with progress.bar(total=len(own), desc=self.progress or "", unit="chunk",
                          show=bool(self.progress)) as shown:
            mine = {}
            for c in own:
                mine[c] = fn(chunks[c])
                shown.update(1)
        if self.world > 1:
            merged: Dict[int, Any] = {}
            for part in self.exchange({str(c): v for c, v in mine.items()}):
                merged.update({int(c): v for c, v in part.items()})
            mine = merged
        return [r for c in range(len(chunks)) for r in mine[c]]

    def _ok(self, text: str, item: dict) -> bool:
        return bool(tasks.score(self.task, text, item)[1])

    # ------------------------------------------------------------------ pre-screen
    def prescreen(self, candidates: Sequence[dict], keep: int) -> Tuple[List[dict], Dict[str, Any]]:
        """Drop candidates the MAS answers right in both of two sampled chains; keep ``keep``."""
        if tasks.get(self.task).answer_type == "safety":
            raise UserError("anchor_pool pre-screening is for reasoning tasks: drop --anchor_pool")

        def probe(chunk: List[dict]) -> List[int]:
            runs = self.runner.run(chunk, samples=2, seed=self.seed + PRESCREEN_SALT)
            return [sum(not self._ok(r.final_text, it) for r in rs) for it, rs in zip(chunk, runs)]
        fails = self._map(candidates, probe)
        survivors = [it for it, f in zip(candidates, fails) if f > 0]
        all_pass = [it for it, f in zip(candidates, fails) if f == 0]
        kept = (survivors + all_pass)[:keep] if len(survivors) < keep else survivors[:keep]
        return kept, {"pool": len(candidates), "survivors": len(survivors),
                      "all_pass_discarded": len(all_pass), "kept": len(kept)}

    # ------------------------------------------------------------------ rollouts
    def _example(self, seat: int, item: dict, history: Sequence[str], prompt: str, target: str,
                 reward: float, success: Optional[bool], finished: bool) -> dict:
        """One fit example. A message that ended with the model's end-of-turn token keeps it
        (as text, which encoding maps back to the token): fitting it teaches the seat where its
        message ends; a message cut by the token budget has none."""
        if self.fit_prompt:
            prompt = self.runner.prompt_text(seat, item, history, mode=self.fit_prompt)
        if finished:
            target += self._end_of_turn[seat]
        return dataclasses.asdict(Example(seat=seat, role=_role(seat), anchor=str(item["anchor"]),
                                          prompt=prompt, target=target, reward=float(reward),
                                          success=success))

    def _shared(self, chunk: List[dict]) -> List[dict]:
        runs = self.runner.run(chunk, samples=self.group, seed=self.seed)
        out = []
        for it, rs in zip(chunk, runs):
            rewards = self._rewards(it, rs)
            outcomes = [self._ok(r.final_text, it) for r in rs]
            labels = self._labels(rewards, outcomes)
            exs = [self._example(k, it, r.texts[:k], r.prompts[k], r.texts[k], w, lab, r.finished[k])
                   for r, w, lab in zip(rs, rewards, labels) for k in self.seats]
            out.append({"anchor": it["anchor"], "outcomes": [int(o) for o in outcomes], "examples": exs})
        return out

    def branches(self, chunk: List[dict]) -> Dict[Tuple[int, int], list]:
        """``credit per_role`` rollouts: {(query index, seat): the ``group`` branched chains}.
        Every branch of (i, k) shares query i's prefix chain up to seat k; seat k samples
        with ``seed``; the seats after k use ``downstream_seed``, the same for every branch."""
        runs = self.runner.run(chunk, samples=self.prefix_samples, seed=self.seed)
        base = [next((r for r in rs if self._ok(r.final_text, it)), rs[0]) if len(rs) > 1 else rs[0]
                for it, rs in zip(chunk, runs)]
        self._prefix_ok = [self._ok(b.final_text, it) for it, b in zip(chunk, base)]
        rows, hist, meta = [], [], []
        for i, (it, b) in enumerate(zip(chunk, base)):
            for k in self.seats:
                for g in range(self.group):
                    rows.append(it)
                    hist.append(b.texts[:k])
                    meta.append((i, k, g))

        def seed_of(r: int, seat: int) -> int:
            i, k, g = meta[r]
            anchor = str(chunk[i]["anchor"])
            if seat == k:
                return row_seed(self.seed, anchor, g, k)
            return row_seed(self.downstream_seed, anchor, 0, seat)
        conts = self.runner.continue_chains(rows, hist, seed_of, samples=[m[2] for m in meta])
        out: Dict[Tuple[int, int], list] = {}
        for (i, k, _g), c in zip(meta, conts):
            out.setdefault((i, k), []).append(c)
        return out

    def _per_role(self, chunk: List[dict]) -> List[dict]:
        by = self.branches(chunk)
        out = []
        for i, it in enumerate(chunk):
            outcomes_all, exs = [], []
            for k in self.seats:
                branch = by[(i, k)]
                rewards = self._rewards(it, branch)
                outcomes = [self._ok(c.final_text, it) for c in branch]
                labels = self._labels(rewards, outcomes)
                outcomes_all += outcomes
                exs += [self._example(k, it, c.texts[:k], c.prompts[k], c.texts[k], w, lab, c.finished[k])
                        for c, w, lab in zip(branch, rewards, labels)]
            out.append({"anchor": it["anchor"], "outcomes": [int(o) for o in outcomes_all], "examples": exs,
                        "prefix_ok": int(self._prefix_ok[i])})
        return out

    def _rewards(self, item: dict, rollouts) -> List[float]:
        if self.reward == "outcome":
            return [1.0 if self._ok(r.final_text, item) else 0.0 for r in rollouts]
        return [gold_loglik(self.runner, item, r.texts) for r in rollouts]

    def _labels(self, rewards: List[float], outcomes: List[bool]) -> List[Optional[bool]]:
        if self.reward == "outcome":
            return list(outcomes)
        mean = sum(rewards) / len(rewards)
        return [w > mean for w in rewards]

    # ------------------------------------------------------------------ the whole step
    def collect(self, items: Sequence[dict], *, pass_band: Optional[Tuple[float, float]] = None
                ) -> Tuple[List[Example], Dict[str, Any]]:
        if pass_band is not None and self.reward != "outcome":
            raise UserError("anchor_pass_band filters by outcome: use it with --reward outcome")
        groups = self._map(items, self._per_role if self.credit == "per_role" else self._shared)
        rates = [sum(g["outcomes"]) / max(1, len(g["outcomes"])) for g in groups]
        kept = [g for g, p in zip(groups, rates) if pass_band is None or pass_band[0] < p < pass_band[1]]
        examples = [Example(**e) for g in kept for e in g["examples"]]
        stats = {
            "queries": len(groups), "kept_queries": len(kept), "examples": len(examples),
            "mean_pass_rate": sum(rates) / max(1, len(rates)),
            "mixed_group_rate": sum(0 < p < 1 for p in rates) / max(1, len(rates)),
            "per_group_outcomes": {g["anchor"]: g["outcomes"] for g in groups},
            "credit": self.credit, "reward": self.reward, "group": self.group,
            # one seat's messages for one query: those whose rewards all agree teach grpo nothing
            "reward_groups": advantages(examples)[1],
        }
        if self.credit == "per_role":
            stats.update(prefix_samples=self.prefix_samples,
                         prefix_right_rate=sum(g["prefix_ok"] for g in groups) / max(1, len(groups)))
        return examples, stats


def _role(seat: int) -> str:
    return role_name(seat)


@torch.no_grad()
def gold_loglik(runner: ChainRunner, item: dict, texts: Sequence[str]) -> float:
    """Mean log-probability per token of ``Answer: <gold>`` as the last seat's reply."""
    last = runner.cfg.n_agents - 1
    model, tok = runner.seat_models.get(last, (runner.model, runner.tok))
    prompt = runner.prompt_text(last, item, texts[:last], tokenizer=tok)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    t_ids = tok(f"Answer: {item['gold']}", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p_ids + t_ids], device=next(model.parameters()).device)
    with runner.seat_context(last, model):
        logits = model(input_ids=ids).logits[0, len(p_ids) - 1:-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(p_ids):, None])
    return float(lp.mean())


# --------------------------------------------------------------------------- the trainer's step
def chain_runner(cfg, model, tokenizer, *, adapter=None, states=None, seat_models=None,
                 generator=None) -> ChainRunner:
    """The chain a TrainConfig describes, on ``model`` (the adapter's wrapped backbone)."""
    runner = ChainRunner(model, tokenizer, cfg.chain_config(words=tasks.get(cfg.task).words), adapter=adapter,
                         seat_states=states, seat_models=seat_models, generator=generator)
    if cfg.reward == "outcome" and runner.cfg.budget(cfg.n_agents - 1) <= 0:
        raise UserError("--reward outcome needs the final agent to generate (--sink_tokens > 0)")
    return runner


def load_seat_models(backbones: Dict[int, str], device, dtype: str = "auto") -> Dict[int, Tuple[Any, Any]]:
    """``agent_models``: {seat: (model, tokenizer)}, each from a folder or a hub id."""
    return {seat: load_model(src, device, what=f"agent_models seat {seat}", dtype=dtype)
            for seat, src in backbones.items()}


def collect_fitset(cfg, runner: ChainRunner, *, collection: int = 0, init_sha: str = "none",
                   rank: int = 0, world: int = 1, exchange: Optional[Exchange] = None) -> FitSet:
    """One collection of a TrainConfig: pick the queries (the ``collection``-th fresh slice of
    the pool), pre-screen them, roll out, filter; an ``sft`` FitSet keyed by :func:`collect_key`
    whose ``anchor_keys`` list every query looked at (the evaluation leakage check uses them)."""
    t0 = time.time()
    collector = Collector(runner, cfg.task, cfg.adapted_seats(), group=cfg.group, credit=cfg.credit,
                          reward=cfg.reward, seed=cfg.seed, downstream_seed=cfg.downstream_seed,
                          chunk=cfg.gen_chunk, prefix_samples=cfg.prefix_samples,
                          fit_prompt=cfg.fit_prompt, rank=rank, world=world,
                          exchange=exchange,
                          progress=None if rank or cfg.quiet else f"collection {collection}")
    pool = queries.pool(cfg.task, seed=cfg.seed, split=cfg.anchor_split, path=cfg.task_path, n_ops=cfg.n_ops)
    keep = cfg.collection_anchors(collection)
    width = lambda n: max(cfg.anchor_pool or 0, n)   # noqa: E731 (candidates looked at for n kept)
    cands = queries.training_slice(pool, width(cfg.collection_anchors(1)), offset=cfg.anchor_offset,
                                   collection=collection, first=width(cfg.anchors))
    stats: Dict[str, Any] = {}
    items = cands[-keep:]
    if cfg.anchor_pool and cfg.anchor_pool > keep:
        items, stats["prescreen"] = collector.prescreen(cands, keep)
    examples, more = collector.collect(items, pass_band=cfg.pass_band())
    stats.update(more, collection=collection, seconds=round(time.time() - t0, 2))
    return FitSet(examples, "sft", collect_key(cfg, init_sha=init_sha, collection=collection), stats,
                  anchor_keys=[str(it["anchor"]) for it in cands])
