"""Configuration: dataclass defaults, then a YAML file, then command-line overrides.

Overrides take either form, and may be mixed:

    --rho 0.1 --local_only          # the reference implementation's flag style (a bare flag
                                    # sets a bool to true)
    rho=0.1 local_only=true         # key=value

Keys are the dataclass's field names (the reference implementation's flag names). Unknown
keys, in the YAML file or on the command line, are rejected with the closest valid
name; values are converted to the field's type, and the dataclass's
``__post_init__`` says how to fix a bad value. :func:`to_yaml_dict` gives the
resolved configuration that rank 0 writes next to the outputs.

Each key is documented where it is defined: :func:`key` makes a dataclass field whose metadata
holds its one-line help, its choice list and its help group, and :func:`from_component` makes a
flat key that copies a component's field (default, help and choices), so the two cannot drift.
A number's range is said there once too: its floor (``at_least``, or ``above`` for a strict one),
a strict upper bound (``below``), and for a setting that sizes memory or work its ceiling
(``at_most``, a constant of :mod:`admm_dist.core.constants`); ``--help`` shows them and
:func:`check_bounds` refuses a value outside them in one line, before anything is allocated.
:func:`format_help` renders the grouped ``--help`` from that metadata.

The YAML file is read by :func:`~admm_dist.core.yaml_file.load_yaml` (strict, and under ceilings).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import textwrap
import typing
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type, TypeVar

import yaml

from admm_dist.core.errors import ConfigError
from admm_dist.core.yaml_file import load_yaml

T = TypeVar("T")


def default_of(component: type, name: str) -> Any:
    """The default of field ``name`` of the dataclass ``component``: a flat configuration that
    exposes a component's field takes its default from here, so it is written once."""
    field = _fields(component)[name]
    if field.default is dataclasses.MISSING:
        raise TypeError(f"{component.__name__}.{name} has no plain default")
    return field.default


# What a key is to a run's fingerprint (the identity a checkpoint must match), said once at the key:
# - "value": it changes what is computed; its value is fingerprinted (the default);
# - "ignored": it does not change the numbers (a path, logging, a bound, memory, k_outer);
# - "content": a file whose content the trainer fingerprints, not its path (moved, it still resumes);
# - "resumable": it changes the numbers but may change on resume (a checkpoint records it).
FINGERPRINT_ROLES = ("value", "ignored", "content", "resumable")


def key(default: Any, help: str, *, choices: Any = None, group: Optional[str] = None,
        metavar: Optional[str] = None, at_least: Optional[float] = None, above: Optional[float] = None,
        below: Optional[float] = None, at_most: Optional[float] = None, fingerprint: str = "value") -> Any:
    """A configuration field with its one-line ``help``, its ``choices`` (a constant list or
    dict of the owning module; a dict gives its keys), its ``--help`` ``group``, a number's range
    (``at_least`` or ``above``, ``below``) and, for a setting that sizes memory or work, its
    ceiling ``at_most`` (see :func:`check_bounds`), and what it is to a run's ``fingerprint``
    (:data:`FINGERPRINT_ROLES`)."""
    if not help.strip() or "\n" in help:
        raise TypeError(f"help must be one non-empty line, got {help!r}")
    if fingerprint not in FINGERPRINT_ROLES:
        raise TypeError(f"fingerprint={fingerprint!r}: one of {FINGERPRINT_ROLES}")
    if at_least is not None and above is not None:
        raise TypeError("give at_least or above, not both")
    meta = {"help": help, "choices": None if choices is None else tuple(choices), "group": group,
            "metavar": metavar, "at_least": at_least, "above": above, "below": below, "at_most": at_most,
            "fingerprint": fingerprint}
    return dataclasses.field(default=default, metadata=meta)


def from_component(component: type, name: str, *, group: Optional[str] = None,
                   at_most: Optional[float] = None) -> Any:
    """A flat field that mirrors field ``name`` of the dataclass ``component``: its default, help,
    choices, range, ceiling and fingerprint role are the component's (written once, there); ``group``
    places it in ``--help``; ``at_most`` gives the flat key a ceiling its component does not check."""
    field = _fields(component)[name]
    if not field.metadata.get("help"):
        raise TypeError(f"{component.__name__}.{name} has no help: define it with config_file.key")
    return dataclasses.field(default=default_of(component, name), metadata={
        **field.metadata, "group": group or field.metadata.get("group"), "component": component,
        "at_most": field.metadata.get("at_most") if at_most is None else at_most})


def keys_by_fingerprint(cls: type, role: str) -> Tuple[str, ...]:
    """The keys of ``cls`` whose fingerprint role is ``role`` (:data:`FINGERPRINT_ROLES`), in order."""
    if role not in FINGERPRINT_ROLES:
        raise ValueError(f"role={role!r}: one of {FINGERPRINT_ROLES}")
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("fingerprint", "value") == role)


def _number(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _range(m: Mapping[str, Any]) -> Optional[str]:
    """A field's range as ``--help`` and the refusal say it (``> 0``, ``>= 1``, ``in [0, 1)``), or None."""
    low, open_low = (m["above"], True) if m.get("above") is not None else (m.get("at_least"), False)
    high = m.get("below")
    if low is not None and high is not None:
        return f"in {'(' if open_low else '['}{_number(low)}, {_number(high)})"
    if low is not None:
        return f"{'>' if open_low else '>='} {_number(low)}"
    return None if high is None else f"< {_number(high)}"


def _within(value: float, m: Mapping[str, Any]) -> bool:
    return ((m.get("above") is None or value > m["above"])
            and (m.get("at_least") is None or value >= m["at_least"])
            and (m.get("below") is None or value < m["below"]))


def check_bounds(obj: Any, error: Type[Exception] = ConfigError) -> None:
    """Refuse, in one line naming the range and the default, a field of the dataclass instance
    ``obj`` that is not a finite number inside its range (``at_least``/``above``, ``below``), or
    one above its ceiling (``at_most``), as ``error``. A field that is None (unset) is not checked.
    A flat configuration checks its keys first, so that the line names the key the user gave."""
    for f in dataclasses.fields(obj):
        m, value = f.metadata, getattr(obj, f.name)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        rule = _range(m)
        if rule is not None and not (number and math.isfinite(value) and _within(value, m)):
            kind = "an integer" if isinstance(f.default, int) or isinstance(value, int) else "a number"
            raise error(f"{f.name}={value!r}: use {kind} {rule} (default {shown(f.default)})")
        limit = m.get("at_most")
        if limit is not None and number and value > limit:
            raise error(f"{f.name}={_number(value)} exceeds the ceiling {_number(limit)}: "
                        f"use at most {_number(limit)}")


def meta(cls: type, name: str) -> Mapping[str, Any]:
    """The help metadata of field ``name`` (help, choices, group, metavar; component when it mirrors one)."""
    return _fields(cls)[name].metadata


def shown(value: Any) -> str:
    """A default as ``--help`` shows it (YAML's spelling: true, false, none)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if value == "" else str(value)


def value_type(cls: type, name: str) -> type:
    """The type of field ``name``'s value (``X`` for ``Optional[X]``)."""
    tp = typing.get_type_hints(cls)[name]
    return next((a for a in typing.get_args(tp) if a is not type(None)), tp)


def metavar_of(cls: type, name: str) -> str:
    """What ``--help`` shows after ``--name``: the field's metavar, else NAME for a choice, N for an
    integer, X for a number, TEXT for a string, nothing for a boolean (a bare flag)."""
    field = _fields(cls)[name]
    tp = value_type(cls, name)
    if tp is bool:
        return ""
    if field.metadata.get("metavar"):
        return field.metadata["metavar"]
    return "NAME" if field.metadata.get("choices") else {int: "N", float: "X"}.get(tp, "TEXT")


def format_help(cls: type, groups: Sequence[str], width: int = 100, column: int = 32) -> str:
    """Every field of ``cls`` by group (in ``groups``' order): ``--key METAVAR``, its meaning,
    its choices and its default. A field outside ``groups`` is an error (it would be hidden)."""
    by_group: Dict[str, List[str]] = {g: [] for g in groups}
    pad = " " * column
    for f in dataclasses.fields(cls):
        group = f.metadata.get("group")
        if group not in by_group or not f.metadata.get("help"):
            raise TypeError(f"{cls.__name__}.{f.name} needs help and one of the groups {list(groups)}")
        head = f"  --{f.name} {metavar_of(cls, f.name)}".rstrip()
        tail = f"default: {shown(f.default)}"
        if f.metadata.get("at_most") is not None:
            tail = f"at most {_number(f.metadata['at_most'])}; {tail}"
        if _range(f.metadata):
            tail = f"{_range(f.metadata)}; {tail}"
        if f.metadata.get("choices"):
            tail = f"choices: {' | '.join(map(str, f.metadata['choices']))}; {tail}"
        lines = [ln for text in (f.metadata["help"], tail) for ln in textwrap.wrap(
            text, width - column, break_on_hyphens=False, break_long_words=False)]
        first = head.ljust(column) + lines[0] if len(head) < column - 1 else head + "\n" + pad + lines[0]
        by_group[group].append("\n".join([first] + [pad + ln for ln in lines[1:]]))
    return "\n\n".join(f"{g}:\n" + "\n".join(rows) for g, rows in by_group.items() if rows)


def _fields(cls) -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _unknown(key: str, known: Sequence[str], where: str, listed_by: str = "--help") -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown key {key!r} in {where}{hint}: valid keys are listed by {listed_by}")


def _parse_bool(key: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    s = str(raw).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}={raw!r} is not a boolean: use true or false")


def coerce(key: str, tp: Any, raw: Any) -> Any:
    """Convert ``raw`` (a YAML value or a command-line string) to the field type ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        inner = [a for a in args if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "null", "")):
            return None
        return coerce(key, inner[0], raw)
    if origin is typing.Literal:
        choices = args
        value = raw if not isinstance(raw, str) else raw.strip()
        for c in choices:
            if value == c or str(value) == str(c):
                return c
        raise ConfigError(f"{key}={raw!r} is not one of {', '.join(map(str, choices))}")
    if tp is bool:
        return _parse_bool(key, raw)
    if tp is int:
        if isinstance(raw, bool):
            raise ConfigError(f"{key}={raw!r} must be an integer")
        try:
            return int(raw) if not isinstance(raw, float) or raw.is_integer() else _bad_int(key, raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={raw!r} must be an integer") from None
    if tp is float:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={raw!r} must be a number") from None
    if tp is str:
        if isinstance(raw, list) and all(isinstance(x, (str, int, float)) for x in raw):
            raise ConfigError(f"{key} must be a string, got a list: write it as one string, "
                              f"e.g. {key}={','.join(map(str, raw))}")
        if isinstance(raw, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {type(raw).__name__}")
        return str(raw)
    if origin in (list, tuple, List, Tuple):
        if isinstance(raw, str):
            raw = [x for x in raw.split(",") if x.strip()]
        inner = args[0] if args else str
        return [coerce(key, inner, x) for x in raw]
    return raw


def _bad_int(key: str, raw: Any) -> int:
    raise ConfigError(f"{key}={raw!r} must be an integer")


def parse_overrides(argv: Sequence[str], cls) -> Dict[str, Any]:
    """``--key value``, ``--flag`` (bool true), ``--key=value`` and ``key=value`` -> {key: raw}."""
    fields = _fields(cls)
    hints = typing.get_type_hints(cls)
    out: Dict[str, Any] = {}
    i = 0
    argv = list(argv)
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("--"):
            body = tok[2:]
            if "=" in body:
                key, raw = body.split("=", 1)
            else:
                key = body
                if key not in fields:
                    raise _unknown(key, fields, "the command line")
                is_bool = hints[key] is bool
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                if is_bool and (nxt is None or nxt.startswith("--") or "=" in nxt
                                or nxt.lower() not in ("true", "false", "1", "0", "yes", "no")):
                    raw = True
                else:
                    if nxt is None:
                        raise ConfigError(f"--{key} needs a value")
                    raw = nxt
                    i += 1
        elif "=" in tok:
            key, raw = tok.split("=", 1)
        else:
            raise ConfigError(f"cannot read {tok!r}: write overrides as --key value or key=value")
        key = key.replace("-", "_")
        if key not in fields:
            raise _unknown(key, fields, "the command line")
        out[key] = raw
        i += 1
    return out


def _optional(tp: Any) -> bool:
    """Whether ``None`` is a value of the field type ``tp`` (``Optional[X]``, ``Any``)."""
    return tp is Any or (typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp))


def build(cls: Type[T], *layers: Tuple[str, Mapping[str, Any]], listed_by: str = "--help") -> T:
    """Apply (source name, {key: raw}) layers over the dataclass defaults; an unknown key's error
    says the valid keys are listed by ``listed_by``."""
    fields = _fields(cls)
    hints = typing.get_type_hints(cls)
    values: Dict[str, Any] = {}
    for where, layer in layers:
        for key, raw in layer.items():
            if key not in fields:
                raise _unknown(key, fields, where, listed_by)
            if raw is None and not _optional(hints[key]) and fields[key].default is not None:
                raise ConfigError(f"{key} is empty (null) in {where}: give it a value, or delete the line to "
                                  f"keep the default {shown(fields[key].default)}")
            values[key] = coerce(key, hints[key], raw)
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def load(cls: Type[T], argv: Sequence[str]) -> T:
    """``[--config FILE] [overrides...]`` -> a validated config."""
    argv = list(argv)
    path: Optional[str] = None
    rest: List[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--config" or argv[i].startswith("--config="):
            if argv[i] == "--config" and i + 1 >= len(argv):
                raise ConfigError("--config needs a YAML file path")
            given = argv[i + 1] if argv[i] == "--config" else argv[i].split("=", 1)[1]
            if path is not None:
                raise ConfigError(f"--config given twice ({path}, {given}): pass one file, and "
                                  "override single keys with key=value")
            path = given
            i += 2 if argv[i] == "--config" else 1
        else:
            rest.append(argv[i])
            i += 1
    layers = []
    if path:
        layers.append((path, load_yaml(path)))
    layers.append(("the command line", parse_overrides(rest, cls)))
    return build(cls, *layers)


def to_yaml_dict(cfg: Any) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_yaml_dict(cfg), sort_keys=False)
