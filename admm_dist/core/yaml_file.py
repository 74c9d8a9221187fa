"""Reading a YAML config file: strict, bounded, and every bad file one line.

:func:`load_yaml` gives the mapping of a ``--config`` file. PyYAML's safe loader is made strict
(a key given twice in one mapping is refused instead of the last one kept silently) and bounded:
a file larger than :data:`~admm_dist.core.constants.MAX_CONFIG_BYTES` is not read past that,
nesting deeper than ``MAX_CONFIG_DEPTH`` is refused while composing (before Python's recursion
limit), and a document of more than ``MAX_CONFIG_NODES`` values once its aliases are expanded (an
"alias bomb") is refused on the composed graph, before anything is built. Every problem is one
:class:`~admm_dist.core.errors.ConfigError` line naming the file, the place and the fix.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Tuple

import yaml

from admm_dist.core.constants import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_CONFIG_NODES
from admm_dist.core.errors import ConfigError, one_line


class _DuplicateKey(Exception):
    """A key given twice in one YAML mapping (raised by :class:`_StrictLoader`)."""

    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(key, line, first)
        self.key, self.line, self.first = key, line, first


class _Beyond(Exception):
    """A YAML document past a ceiling of a config file (raised by :class:`_StrictLoader`): its
    message, which follows the file's path, names the ceiling, the place and the fix."""


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last
    value silently), nesting deeper than ``MAX_CONFIG_DEPTH`` (checked while composing, before
    Python's recursion limit is reached) and a document of more than ``MAX_CONFIG_NODES`` values
    once its aliases are expanded (checked on the composed graph, before anything is constructed:
    an alias bomb is refused without being built). Merge keys (``<<``) may still be overridden;
    valid files load unchanged."""

    _depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_CONFIG_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise _Beyond(f": line {line}: nested deeper than {MAX_CONFIG_DEPTH} levels, the ceiling of a "
                          "config file (MAX_CONFIG_DEPTH): a config is flat key: value pairs; "
                          "flatten the value")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None and _expanded_size(node, MAX_CONFIG_NODES) > MAX_CONFIG_NODES:
            raise _Beyond(f" holds more than {MAX_CONFIG_NODES} values once its aliases (*name) are "
                          "expanded, the ceiling of a config file (MAX_CONFIG_NODES): a config is flat key: "
                          "value pairs; write each value once")
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: Dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                k = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(k)
                except TypeError:        # an unhashable key: SafeLoader's own error says so
                    continue
                line = key_node.start_mark.line + 1
                if first is not None:
                    raise _DuplicateKey(k, line, first)
                seen[k] = line
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """The number of values under ``root`` with every alias expanded (a node counted each time it is
    reached), or ``limit + 1`` once past ``limit`` (a recursive alias is past any limit). Each node is
    sized once, so a bomb of nine aliases nine deep costs a few dozen steps; the nesting is bounded
    by ``MAX_CONFIG_DEPTH``, so the recursion is too."""
    sizes: Dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return limit + 1 if known < 0 else known      # < 0: an alias of a node being sized
        sizes[id(node)] = -1
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        total = 1
        for child in children:
            total += size(child)
            if total > limit:
                break
        sizes[id(node)] = min(total, limit + 1)
        return sizes[id(node)]

    return size(root)


def _line_col(text: str, position: int) -> Tuple[int, int]:
    """1-based (line, column) of character ``position`` of ``text``."""
    before = text[:position]
    return before.count("\n") + 1, position - (before.rfind("\n") + 1) + 1


def load_yaml(path: str) -> Dict[str, Any]:
    """The mapping of a YAML config file; every bad file is one :class:`ConfigError` line that
    names the path (a folder, a binary file, a syntax error at line and column, a duplicate key, a
    file past a ceiling: over ``MAX_CONFIG_BYTES``, nested too deep, too many values)."""
    if not os.path.exists(path):
        raise ConfigError(f"config file {path} does not exist: check the --config path")
    if os.path.isdir(path):
        raise ConfigError(f"config file {path} is a folder: give a YAML file to --config, "
                          "e.g. --config configs/cpu/admm_ring.yaml")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)     # never more than the ceiling (a huge file, a device)
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror or type(e).__name__}): "
                          "give a readable YAML file to --config") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes, the ceiling of a "
                          "config file (MAX_CONFIG_BYTES): give a YAML file of key: value lines, e.g. "
                          "--config configs/cpu/admm_ring.yaml")
    not_text = (f"config file {path} is not a text file ({{}}): give a YAML file to --config, "
                "e.g. --config configs/cpu/admm_ring.yaml")
    nul = raw.find(b"\0")
    if nul >= 0:
        raise ConfigError(not_text.format(f"a NUL byte at offset {nul}"))
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(not_text.format(f"byte {raw[e.start]:#04x} at offset {e.start} is not "
                                          "UTF-8")) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"{path}: line {e.line}: key {e.key!r} is given twice (first on line {e.first}): "
                          "keep one of them") from None
    except _Beyond as e:
        raise ConfigError(f"{path}{e}") from None
    except yaml.reader.ReaderError as e:
        line, col = _line_col(text, e.position)
        code = e.character if isinstance(e.character, int) else ord(e.character)
        raise ConfigError(not_text.format(f"control character #x{code:04x} at line {line}, column {col}")) \
            from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "an unknown place"
        what = e.problem or e.context or "a syntax error"
        raise ConfigError(f"{path} is not valid YAML at {where}: {what}: fix the file there") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML ({one_line(e)}): fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of key: value, got {type(data).__name__}")
    return data
