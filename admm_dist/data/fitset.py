"""Fit sets: the role-local training examples of the MAS, their file format and filters.

A fit set is the list of :class:`Example` s that the seats are trained on (DESIGN.md sections
4 and 5), together with the collection settings it was built under. This module stores and
loads fit sets, derives one objective's examples from another's, and holds the filters and
the node assignment that run between collection and training:

    load_fitset -> derive -> drop_unclosed_think -> target_composition -> dedup_targets
                -> by_seat -> split_dev -> partition (seat | anchor | pooled)

File format (``admm_dist.data.fitset``, version 1)
--------------------------------------------
UTF-8 JSON Lines, written atomically (never pickled, so loading runs no code).

Line 1 is the header object::

    {"format": "admm_dist.data.fitset", "version": 1,
     "fit_mode": "dpo" | "sft",
     "settings": {...},        # the collection settings the set was built under
     "n_examples": N,          # number of example lines that follow
     "stats": {...},           # collection statistics (free-form JSON)
     "anchor_keys": [...]}     # every query key the collection used (leakage check)

Lines 2..N+1 hold one :class:`Example` each, as a JSON object with exactly the dataclass's
field names (``seat, role, anchor, prompt, target, rejected, rejected_prompt, reward,
rejected_reward, advantage, success, node``). Optional fields may be omitted and take their
defaults; unknown fields are an error. An ``sft`` file holds one message per line (its
``rejected`` fields are null); a ``dpo`` file holds (chosen, rejected) pairs. ``rsft`` is not
a file mode: it is derived from an ``sft`` file at load time (:func:`derive`). Non-finite
numbers are refused on write.

Loading checks, each a one-line :class:`FitSetError` that names the fix: the file exists, every
line is valid JSON (the line number is reported), the header's format and version, that the
number of example lines equals ``n_examples`` (a short file was truncated), every example's
fields and types, and, when the caller passes the settings it would collect under, that they
equal the header's (keys missing on either side count as differences).

Version history: 1 -- first version.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from admm_dist.core.io import atomic_write_bytes

FORMAT = "admm_dist.data.fitset"
VERSION = 1
FILE_MODES = ("dpo", "sft")
DERIVED_MODES = ("dpo", "sft", "rsft")
PARTITION_MODES = ("seat", "anchor")
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class FitSetError(ValueError):
    """A fit set that cannot be used as asked; the message says how to fix it."""


@dataclasses.dataclass(kw_only=True)
class Example:
    seat: int                 # index of the agent seat in the chain whose message is the target
    role: str                 # e.g. "Planner"
    anchor: str               # query ("anchor") key
    prompt: str               # prompt text exactly as the model saw it (chat template applied)
    target: str               # SFT target, or the DPO chosen message
    rejected: Optional[str] = None          # DPO rejected message (None for SFT)
    rejected_prompt: Optional[str] = None   # DPO: the rejected message's prompt when it differs from `prompt`
    reward: float = 0.0       # SFT: the rollout's reward; DPO: reward of chosen
    rejected_reward: Optional[float] = None
    advantage: float = 0.0
    success: Optional[bool] = None          # SFT: did the rollout succeed (rsft keeps only True)
    node: int = -1            # training node after partitioning


@dataclasses.dataclass
class FitSet:
    examples: List[Example]
    fit_mode: str
    settings: Dict[str, Any]
    stats: Dict[str, Any] = dataclasses.field(default_factory=dict)
    anchor_keys: List[str] = dataclasses.field(default_factory=list)
    path: Optional[str] = None


_FIELDS = {f.name: f for f in dataclasses.fields(Example)}
_REQUIRED = tuple(n for n, f in _FIELDS.items()
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


# ----------------------------------------------------------------------------- validation

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


_CHECKS = {
    "seat": (_is_int, "an integer"),
    "role": (lambda v: isinstance(v, str), "a string"),
    "anchor": (lambda v: isinstance(v, str), "a string"),
    "prompt": (lambda v: isinstance(v, str), "a string"),
    "target": (lambda v: isinstance(v, str), "a string"),
    "rejected": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "rejected_prompt": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "reward": (_is_num, "a finite number"),
    "rejected_reward": (lambda v: v is None or _is_num(v), "a finite number or null"),
    "advantage": (_is_num, "a finite number"),
    "success": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "node": (_is_int, "an integer"),
}


def _check_example(ex: Example, fit_mode: str, where: str) -> None:
    if not isinstance(ex, Example):
        raise FitSetError(f"{where}: expected an admm_dist.data.fitset.Example, got "
                          f"{type(ex).__name__}")
    for name, (ok, what) in _CHECKS.items():
        if not ok(getattr(ex, name)):
            raise FitSetError(f"{where}: field {name!r} must be {what}, got "
                              f"{getattr(ex, name)!r}")
    if ex.seat < 0:
        raise FitSetError(f"{where}: seat must be >= 0, got {ex.seat}")
    if fit_mode == "dpo" and ex.rejected is None:
        raise FitSetError(f"{where}: a dpo fit set needs a rejected message on every example; "
                          f"save it with fit_mode='sft' or derive DPO pairs first")
    if fit_mode == "sft" and (ex.rejected is not None or ex.rejected_prompt is not None
                              or ex.rejected_reward is not None):
        raise FitSetError(f"{where}: an sft fit set must not carry rejected messages; "
                          f"save it with fit_mode='dpo' or clear the rejected fields")


def _check_mode(fit_mode: Any, allowed: Sequence[str], what: str) -> None:
    if fit_mode not in allowed:
        raise FitSetError(f"{what} must be one of {list(allowed)}, got {fit_mode!r}")


def _canonical(obj: Any, what: str) -> Any:
    """``obj`` as it reads back from JSON (tuples become lists); refuses what JSON cannot hold."""
    try:
        return json.loads(json.dumps(obj, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise FitSetError(f"{what} must be plain finite JSON data (dict/list/str/number/bool/"
                          f"null): {exc}") from None


# ----------------------------------------------------------------------------- file I/O

def save_fitset(path: str, examples: Sequence[Example], *, fit_mode: str,
                settings: Dict[str, Any], stats: Optional[Dict[str, Any]] = None,
                anchor_keys: Optional[Iterable[str]] = None) -> None:
    """Validate ``examples`` and write them with a header to ``path``, atomically."""
    _check_mode(fit_mode, FILE_MODES, "fit_mode of a saved fit set (rsft is derived from sft)")
    if not isinstance(settings, dict):
        raise FitSetError(f"settings must be a dict, got {type(settings).__name__}")
    examples = list(examples)
    for i, ex in enumerate(examples):
        _check_example(ex, fit_mode, f"example {i}")
    keys = [] if anchor_keys is None else list(anchor_keys)
    if not all(isinstance(k, str) for k in keys):
        raise FitSetError("anchor_keys must be strings")
    header = {"format": FORMAT, "version": VERSION, "fit_mode": fit_mode,
              "settings": _canonical(settings, "settings"), "n_examples": len(examples),
              "stats": _canonical(stats or {}, "stats"), "anchor_keys": keys}
    lines = [json.dumps(header, ensure_ascii=False, allow_nan=False)]
    for ex in examples:
        lines.append(json.dumps(dataclasses.asdict(ex), ensure_ascii=False, allow_nan=False))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))


_MISSING = "<missing>"


def settings_diff(file_settings: Dict[str, Any], requested: Dict[str, Any],
                  ignore: Iterable[str] = ()) -> Dict[str, Tuple[Any, Any]]:
    """Keys whose values differ, as ``{key: (file, requested)}``; a key missing on one side
    counts as a difference and shows as ``"<missing>"``."""
    req = _canonical(requested, "requested settings")
    skip = set(ignore)
    diff = {}
    for k in sorted(set(file_settings) | set(req)):
        if k in skip:
            continue
        a = file_settings.get(k, _MISSING)
        b = req.get(k, _MISSING)
        if (k in file_settings) != (k in req) or a != b:
            diff[k] = (a, b)
    return diff


def _example_from_json(obj: Any, where: str) -> Example:
    if not isinstance(obj, dict):
        raise FitSetError(f"{where}: an example must be a JSON object, got "
                          f"{type(obj).__name__}")
    unknown = sorted(set(obj) - set(_FIELDS))
    if unknown:
        raise FitSetError(f"{where}: unknown example fields {unknown}; the file was written "
                          f"by another format version: rebuild it")
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise FitSetError(f"{where}: missing example fields {missing}: rebuild the fit set")
    for name, value in obj.items():
        ok, what = _CHECKS[name]
        if not ok(value):
            raise FitSetError(f"{where}: field {name!r} must be {what}, got {value!r}")
    return Example(**obj)


def load_fitset(path: str, *, settings: Optional[Dict[str, Any]] = None,
                ignore: Iterable[str] = ("fit_mode",)) -> FitSet:
    """Read and check a fit set; with ``settings``, refuse one built under other settings."""
    if not os.path.isfile(path):
        raise FitSetError(f"fit set {path} does not exist: collect it first or fix "
                          f"--fitset_cache")
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FitSetError(f"{path}: not UTF-8 text ({exc}): the file is corrupt; delete it "
                          f"and collect again") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()                      # the newline that ends the last line

    def parse(lineno: int) -> Any:
        try:
            return json.loads(lines[lineno - 1])
        except json.JSONDecodeError as exc:
            raise FitSetError(f"{path}: line {lineno} is not valid JSON ({exc.msg}, column "
                              f"{exc.colno}): the file is corrupt; delete it and collect "
                              f"again") from None

    if not lines:
        raise FitSetError(f"{path}: empty file, no header: delete it and collect again")
    header = parse(1)
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise FitSetError(f"{path}: not an {FORMAT} file (format={got!r}): point "
                          f"--fitset_cache at a fit set written by admm_dist")
    version = header.get("version")
    if version != VERSION:
        raise FitSetError(f"{path}: {FORMAT} version {version!r}, this admm_dist reads "
                          f"version {VERSION}: rebuild the fit set with this version")
    fit_mode = header.get("fit_mode")
    if fit_mode not in FILE_MODES:
        raise FitSetError(f"{path}: header fit_mode {fit_mode!r} is not one of "
                          f"{list(FILE_MODES)}: the file is corrupt; rebuild it")
    n_examples = header.get("n_examples")
    if not _is_int(n_examples) or n_examples < 0:
        raise FitSetError(f"{path}: header n_examples {n_examples!r} is not a count: the "
                          f"file is corrupt; rebuild it")
    file_settings = header.get("settings")
    if not isinstance(file_settings, dict):
        raise FitSetError(f"{path}: header carries no settings object: rebuild the fit set")
    stats = header.get("stats") or {}
    anchor_keys = header.get("anchor_keys") or []
    if not isinstance(stats, dict) or not isinstance(anchor_keys, list):
        raise FitSetError(f"{path}: header stats/anchor_keys malformed: rebuild the fit set")

    if settings is not None:
        diff = settings_diff(file_settings, settings, ignore)
        if diff:
            shown = ", ".join(f"{k}: {a!r} != {b!r}" for k, (a, b) in diff.items())
            raise FitSetError(f"{path} was built with different settings (file, requested): "
                              f"{{{shown}}}: collect a new fit set or use matching "
                              f"settings")

    n_lines = len(lines) - 1
    if n_lines != n_examples:
        raise FitSetError(f"{path}: header says {n_examples} examples but the file holds "
                          f"{n_lines} example lines (truncated or appended to): delete it "
                          f"and collect again")
    examples = []
    for lineno in range(2, len(lines) + 1):
        ex = _example_from_json(parse(lineno), f"{path}: line {lineno}")
        try:
            _check_example(ex, fit_mode, f"{path}: line {lineno}")
        except FitSetError as exc:
            raise FitSetError(f"{exc} (the file is inconsistent: rebuild it)") from None
        examples.append(ex)
    return FitSet(examples=examples, fit_mode=fit_mode, settings=file_settings,
                  stats=stats, anchor_keys=[str(k) for k in anchor_keys], path=path)


def content_key(f: "FitSet") -> str:
    """A sha256 (hex) of a fit set's examples: what a run trained on, whatever its path."""
    return settings_key({"examples": [dataclasses.asdict(e) for e in f.examples]})


def settings_key(d: Dict[str, Any]) -> str:
    """A stable sha256 (hex) of the canonical JSON of ``d``: sorted keys, no whitespace."""
    if not isinstance(d, dict):
        raise FitSetError(f"settings must be a dict, got {type(d).__name__}")
    try:
        text = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise FitSetError(f"settings must be plain finite JSON data to be keyed: {exc}") from None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- derivation

def derive(fs: FitSet, fit_mode: str, *, pair_by: Optional[str] = None) -> List[Example]:
    """The ``fit_mode`` examples of ``fs`` as new objects (``fs`` is not changed).

    From an ``sft`` fit set:
      * ``sft``  -- every message;
      * ``rsft`` -- messages whose rollout succeeded (``success is True``);
      * ``dpo``  -- pairs built per group of messages that share (seat, anchor, prompt), i.e.
        alternatives sampled at one branch point. Pairing rule: in each group (groups in
        order of first appearance) let S be the successful messages and F the failed ones
        (``success is False``; unlabelled messages are not paired), each in file order.
        If both are non-empty, pair i = (S[i % |S|], F[i % |F|]) for i < max(|S|, |F|):
        every labelled message is used, no pair repeats, and a group gives at most
        max(|S|, |F|) pairs instead of |S|*|F|. Pairs whose two texts are identical are
        skipped (they carry no preference). A pair takes the chosen message's seat, role,
        anchor, prompt, reward and node, ``rejected_reward`` = the failed message's reward,
        ``advantage`` = chosen.advantage - rejected.advantage (the preference margin),
        ``success`` = None.
    From a ``dpo`` fit set only ``dpo`` (the pairs themselves).
    """
    _check_mode(fit_mode, DERIVED_MODES, "fit_mode")
    src = fs.fit_mode
    if src == "dpo" and fit_mode == "dpo":
        return [dataclasses.replace(ex) for ex in fs.examples]
    if src != "sft":
        raise FitSetError(f"cannot derive {fit_mode!r} examples from a {src!r} fit set: "
                          f"collect with fit_mode sft (or {fit_mode}) instead")
    if fit_mode == "sft":
        return [dataclasses.replace(ex) for ex in fs.examples]
    if fs.examples and all(ex.success is None for ex in fs.examples):
        raise FitSetError(f"cannot derive {fit_mode!r} examples: the sft fit set carries no "
                          f"success labels; collect with a success-labelled reward")
    if fit_mode == "rsft":
        return [dataclasses.replace(ex) for ex in fs.examples if ex.success is True]

    if pair_by is None:
        pair_by = "anchor" if (fs.settings.get("credit") == "shared" or
                               fs.settings.get("sampling_structure") == "actual_trajectory") else "prompt"
    if pair_by not in ("prompt", "anchor"):
        raise FitSetError(f"pair_by={pair_by!r}: use prompt or anchor")
    groups: Dict[Tuple[int, str, str], Tuple[List[Example], List[Example]]] = {}
    for ex in fs.examples:
        key = (ex.seat, ex.anchor, ex.prompt if pair_by == "prompt" else "")
        good, bad = groups.setdefault(key, ([], []))
        if ex.success is True:
            good.append(ex)
        elif ex.success is False:
            bad.append(ex)
    pairs = []
    for good, bad in groups.values():
        if not good or not bad:
            continue
        for i in range(max(len(good), len(bad))):
            c, r = good[i % len(good)], bad[i % len(bad)]
            if c.target == r.target:
                continue
            pairs.append(Example(seat=c.seat, role=c.role, anchor=c.anchor, prompt=c.prompt,
                                 target=c.target, rejected=r.target,
                                 rejected_prompt=None if r.prompt == c.prompt else r.prompt,
                                 reward=c.reward, rejected_reward=r.reward,
                                 advantage=c.advantage - r.advantage, success=None,
                                 node=c.node))
    return pairs


# ----------------------------------------------------------------------------- filters

def _unclosed(t: Optional[str]) -> bool:
    if t is None:
        return False
    i = t.rfind(THINK_OPEN)
    return i >= 0 and t.find(THINK_CLOSE, i + len(THINK_OPEN)) < 0


def drop_unclosed_think(examples: Iterable[Example]) -> Tuple[List[Example], int]:
    """Drop examples whose target or rejected text opens a ``<think>`` block that no later
    ``</think>`` closes (a message cut off mid-reasoning). Returns (kept, n_dropped)."""
    kept, dropped = [], 0
    for ex in examples:
        if _unclosed(ex.target) or _unclosed(ex.rejected):
            dropped += 1
        else:
            kept.append(ex)
    return kept, dropped


def visible_text(t: str) -> str:
    """The text after the first ``</think>``, stripped; ``t`` stripped if there is none."""
    i = t.find(THINK_CLOSE)
    return (t[i + len(THINK_CLOSE):] if i >= 0 else t).strip()


def dedup_targets(examples: Sequence[Example], cap: int) -> List[Example]:
    """Per node (examples grouped by ``node`` when it is set (>= 0), else by ``seat``), keep
    at most ``cap`` examples with one visible target text: the highest-``advantage`` ones
    (ties: the earlier one), returned in their original order. ``cap`` 0 turns this off."""
    if not _is_int(cap) or cap < 0:
        raise FitSetError(f"dedup_targets cap must be an integer >= 0 (0 = off), got {cap!r}")
    examples = list(examples)
    if cap == 0:
        return examples
    order = sorted(range(len(examples)), key=lambda i: -examples[i].advantage)  # stable
    seen: Dict[Tuple[str, int, str], int] = {}
    keep = set()
    for i in order:
        ex = examples[i]
        key = (("node", ex.node) if ex.node >= 0 else ("seat", ex.seat)) + (visible_text(ex.target),)
        if seen.get(key, 0) < cap:
            seen[key] = seen.get(key, 0) + 1
            keep.add(i)
    return [ex for i, ex in enumerate(examples) if i in keep]


def target_composition(per_node: Sequence[Sequence[Example]]) -> List[Dict[str, Any]]:
    """Per node: n examples, distinct visible targets, and the share of the most common one
    (rounded to 4 places; 0 for an empty node)."""
    out = []
    for node, fset in enumerate(per_node):
        counts: Dict[str, int] = {}
        for ex in fset:
            t = visible_text(ex.target)
            counts[t] = counts.get(t, 0) + 1
        top = max(counts.values()) if counts else 0
        out.append({"node": node, "n": len(fset), "distinct": len(counts),
                    "top_share": round(top / max(1, len(fset)), 4)})
    return out


# ----------------------------------------------------------------------------- node assignment

def split_dev(per_node: Sequence[Sequence[Example]], frac: float,
              seed: int) -> Tuple[List[List[Example]], List[Example]]:
    """Hold out ``round(len * frac)`` examples of every node (before any pooling, so every
    node contributes), chosen by one ``random.Random(seed ^ 0x5EED)`` shuffling the nodes'
    indices in turn. Returns (train_per_node, dev_examples); both keep the original order."""
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
        raise FitSetError(f"dev_frac must lie in [0, 1), got {frac!r}")
    if not _is_int(seed):
        raise FitSetError(f"split_dev seed must be an integer, got {seed!r}")
    if frac == 0:
        return [list(f) for f in per_node], []
    rng = random.Random(seed ^ 0x5EED)
    train, dev = [], []
    for fset in per_node:
        fset = list(fset)
        idx = list(range(len(fset)))
        rng.shuffle(idx)
        held = set(idx[: int(round(len(fset) * frac))])
        dev.extend(fset[i] for i in sorted(held))
        train.append([ex for i, ex in enumerate(fset) if i not in held])
    return train, dev


def by_seat(examples: Iterable[Example], seats: Sequence[int], *,
            drop_others: bool = False) -> List[List[Example]]:
    """Node j gets the examples of seat ``seats[j]`` (in order). Examples of seats not listed
    are an error unless ``drop_others``."""
    seats = list(seats)
    if len(set(seats)) != len(seats):
        raise FitSetError(f"by_seat: seats {seats} list a seat twice; give each seat once")
    where = {s: j for j, s in enumerate(seats)}
    out: List[List[Example]] = [[] for _ in seats]
    others: Dict[int, int] = {}
    for ex in examples:
        j = where.get(ex.seat)
        if j is None:
            others[ex.seat] = others.get(ex.seat, 0) + 1
        else:
            out[j].append(ex)
    if others and not drop_others:
        raise FitSetError(f"fit set holds examples of seats {sorted(others)} (counts "
                          f"{others}) that are not adapted seats {seats}: fix adapt_roles/"
                          f"n_agents to match the fit set, or drop them explicitly")
    return out


def anchor_node(anchor: str, n_partitions: int) -> int:
    """The node an anchor belongs to: sha1 of its key mod ``n_partitions`` (stable across
    processes and runs, unlike ``hash()``)."""
    return int(hashlib.sha1(str(anchor).encode("utf-8")).hexdigest(), 16) % n_partitions


def partition(per_seat: Sequence[Sequence[Example]], *, mode: str = "seat",
              n_partitions: int = 0, pooled: bool = False,
              min_examples: int = 16) -> List[List[Example]]:
    """Distribute examples over training nodes and set every example's ``node`` (in place).

    * ``pooled``: one node holding everything (the centralized arm).
    * ``mode="seat"``: node j = the j-th list of ``per_seat``, unchanged.
    * ``mode="anchor"``: all examples pooled and split over ``n_partitions`` nodes (default
      ``len(per_seat)``) by :func:`anchor_node`, so all examples of a query land on one node;
      a node with fewer than ``min_examples`` examples is an error.
    """
    _check_mode(mode, PARTITION_MODES, "partition mode")
    if not _is_int(n_partitions) or n_partitions < 0:
        raise FitSetError(f"n_partitions must be an integer >= 0 (0 = one per seat), got "
                          f"{n_partitions!r}")
    if pooled and mode == "anchor":
        raise FitSetError("pooled and partition anchor exclude each other: the centralized "
                          "arm uses one node; drop one of the two")
    if mode == "seat" and n_partitions not in (0, len(per_seat)):
        raise FitSetError(f"n_partitions={n_partitions} applies to partition anchor only; "
                          f"set partition anchor or n_partitions 0")
    if pooled:
        merged = [ex for fs in per_seat for ex in fs]
        for ex in merged:
            ex.node = 0
        return [merged]
    if mode == "seat":
        out = []
        for j, fs in enumerate(per_seat):
            fs = list(fs)
            for ex in fs:
                ex.node = j
            out.append(fs)
        return out
    n = n_partitions or len(per_seat)
    if n < 1:
        raise FitSetError("partition anchor needs at least one node: set n_partitions >= 1")
    parts: List[List[Example]] = [[] for _ in range(n)]
    for fs in per_seat:
        for ex in fs:
            j = anchor_node(ex.anchor, n)
            ex.node = j
            parts[j].append(ex)
    thin = [i for i, f in enumerate(parts) if len(f) < min_examples]
    if thin:
        raise FitSetError(f"partition anchor: nodes {thin} hold fewer than {min_examples} "
                          f"examples (sizes {[len(f) for f in parts]}): use fewer partitions "
                          f"(n_partitions) or more anchors")
    return parts
