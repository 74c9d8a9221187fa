"""Fit sets: the role-local training examples of the MAS and their file format.

A fit set is the list of :class:`Example` s that the seats are trained on (docs/design.md
sections 3 and 4), together with the collection settings it was built under. This module owns
the example and fit-set types, the file (its format, checks, :func:`save_fitset` and
:func:`load_fitset`), :func:`settings_diff` and the keys of a fit set's settings and contents.
What runs between loading and training lives beside it:

    load_fitset -> derive -> drop_unclosed_think -> target_composition -> dedup_targets
                -> by_seat -> split_dev -> partition (seat | anchor | pooled)

:mod:`admm_dist.data.derive` holds ``derive`` and the filters, :mod:`admm_dist.data.partition`
the dev split and the assignment of examples to nodes.

File format (``admm_dist.data.fitset``, version 1)
--------------------------------------------
UTF-8 JSON Lines, written atomically (never pickled, so loading runs no code).

Line 1 is the header object::

    {"format": "admm_dist.fitset", "version": 1,
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
a file mode: it is derived from an ``sft`` file at load time
(:func:`admm_dist.data.derive.derive`). Non-finite numbers are refused on write.

Loading checks, each a one-line :class:`FitSetError` that names the fix: the file exists, every
line is under its ceiling (checked while reading, before the line is decoded or parsed: an example
line holds at most :data:`~admm_dist.core.constants.MAX_FITSET_LINE_BYTES`, 1 MiB, the header
``MAX_FITSET_HEADER_BYTES``, 64 MiB, for it lists every query key; saving refuses an example
that would not load back), every line is valid JSON (the line number is reported) whose text
is valid Unicode (no lone surrogate escape such as ``\\ud800``), the header's format and
version, that the number of example lines equals ``n_examples`` (a short file was truncated),
every example's fields and types, and, when the caller passes the settings it would collect
under, that they equal the header's (keys missing on either side count as differences).

Version history: 1 -- first version.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from admm_dist.core.constants import MAX_FITSET_HEADER_BYTES, MAX_FITSET_LINE_BYTES
from admm_dist.core.errors import UserError
from admm_dist.core.io import atomic_write_bytes
from admm_dist.core.text import is_int
from admm_dist.model.objectives import FIT_MODES

FORMAT = "admm_dist.fitset"
VERSION = 1
FILE_MODES = ("dpo", "sft")
DERIVED_MODES = FIT_MODES   # what a fit set can be derived into: the objectives' modes
PARTITION_MODES = ("seat", "anchor")


class FitSetError(UserError):
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

def _is_num(v: Any) -> bool:
    return is_int(v) or (isinstance(v, float) and math.isfinite(v))


_CHECKS = {
    "seat": (is_int, "an integer"),
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
    "node": (is_int, "an integer"),
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


def check_mode(fit_mode: Any, allowed: Sequence[str], what: str) -> None:
    """Refuse a mode outside ``allowed`` (``what`` names the setting in the message)."""
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
    check_mode(fit_mode, FILE_MODES, "fit_mode of a saved fit set (rsft is derived from sft)")
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
    lines = [json.dumps(header, ensure_ascii=False, allow_nan=False).encode("utf-8")]
    for i, ex in enumerate(examples):
        lines.append(json.dumps(dataclasses.asdict(ex), ensure_ascii=False, allow_nan=False).encode("utf-8"))
        if len(lines[-1]) > MAX_FITSET_LINE_BYTES:   # it would not load back
            raise FitSetError(f"example {i} is {len(lines[-1])} bytes as a fit-set line, over the ceiling "
                              f"{MAX_FITSET_LINE_BYTES} (MAX_FITSET_LINE_BYTES): shorten its prompt and "
                              "messages (e.g. a lower max_new_tokens)")
    if len(lines[0]) > MAX_FITSET_HEADER_BYTES:
        raise FitSetError(f"the fit-set header is {len(lines[0])} bytes, over the ceiling "
                          f"{MAX_FITSET_HEADER_BYTES} (MAX_FITSET_HEADER_BYTES): collect on fewer queries, "
                          "or with smaller stats")
    atomic_write_bytes(path, b"\n".join(lines) + b"\n")


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


# A JSON escape of a UTF-16 surrogate: alone (not a pair) it decodes to a str that is not valid
# Unicode, which every later encode (tokenizer, hashing, writing) fails on.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _has_lone_surrogate(obj: Any) -> bool:
    """Whether any string in the parsed JSON value ``obj`` (keys included) holds a lone surrogate."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(obj, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_lone_surrogate(v) for v in obj)
    return False


def _read_lines(path: str) -> List[str]:
    """The file's lines as text (without their newlines), each read under its ceiling before it is
    decoded: the header (line 1) under ``MAX_FITSET_HEADER_BYTES``, an example line under
    ``MAX_FITSET_LINE_BYTES``; a longer line is refused without being read whole."""
    lines: List[str] = []
    with open(path, "rb") as fh:
        while True:
            limit, what = ((MAX_FITSET_HEADER_BYTES, "MAX_FITSET_HEADER_BYTES") if not lines
                           else (MAX_FITSET_LINE_BYTES, "MAX_FITSET_LINE_BYTES"))
            raw = fh.readline(limit + 1)          # a line of ``limit`` bytes and its newline at most
            if not raw:
                return lines
            if len(raw) > limit and not raw.endswith(b"\n"):
                raise FitSetError(f"{path}: line {len(lines) + 1} is longer than {limit} bytes, the ceiling "
                                  f"of a fit-set line ({what}): no example is that long; the file is not one "
                                  "admm_dist wrote, or was edited: rebuild the fit set")
            try:
                lines.append(raw.decode("utf-8").removesuffix("\n"))
            except UnicodeDecodeError as exc:
                raise FitSetError(f"{path}: line {len(lines) + 1} is not UTF-8 text ({exc}): the file is "
                                  f"corrupt; delete it and collect again") from None


def load_fitset(path: str, *, settings: Optional[Dict[str, Any]] = None,
                ignore: Iterable[str] = ("fit_mode",)) -> FitSet:
    """Read and check a fit set; with ``settings``, refuse one built under other settings."""
    if not os.path.isfile(path):
        raise FitSetError(f"fit set {path} does not exist: collect it first or fix "
                          f"--fitset_cache")
    lines = _read_lines(path)

    def parse(lineno: int) -> Any:
        line = lines[lineno - 1]
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FitSetError(f"{path}: line {lineno} is not valid JSON ({exc.msg}, column "
                              f"{exc.colno}): the file is corrupt; delete it and collect "
                              f"again") from None
        if _SURROGATE_ESCAPE.search(line) and _has_lone_surrogate(obj):
            raise FitSetError(f"{path}: line {lineno} holds text that is not valid Unicode (a lone "
                              f"surrogate escape such as \\ud800): the file is corrupt; rebuild it")
        return obj

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
    if not is_int(n_examples) or n_examples < 0:
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
