"""Load a YAML job config and remember where every value came from (file and line).

`load_yaml(path)` returns a `YamlDoc`: the plain data (safe-loaded) plus the line of every key and
list item, so `ConfigError` can say `job.yaml:12`.  Duplicate keys -- which PyYAML silently
resolves to the last one -- are rejected here, because a duplicate usually means one of two
intended settings is being ignored.

Calling contract: raises `ConfigError` (key `config`, or the dotted key for duplicates) for an
unreadable file, a YAML syntax error, a duplicate key or a document that is not a mapping.  An
empty document (or only comments) loads as an empty mapping.  Sexagesimal numbers are off
(`1:4` is text, as in YAML 1.2).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import yaml

from leto_run.errors import ConfigError

Path = tuple  # ("launch", "nnodes") or ("inject", 0)


class _Loader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's base-60 numbers: `nnodes: 1:4` must stay the text "1:4"
    (PyYAML would read it as 64, and `2:4` as 124, silently changing the job)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, re.compile(r"(?!.*:)(?:" + rx.pattern + ")", rx.flags)
             if tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float") else rx)
            for tag, rx in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


@dataclass(frozen=True)
class YamlDoc:
    path: str
    data: dict
    lines: dict = field(default_factory=dict)   # Path -> 1-based line of the key / list item

    def where(self, *keys) -> str:
        """`job.yaml:12` for the deepest known prefix of `keys` (the file alone if none)."""
        for n in range(len(keys), 0, -1):
            line = self.lines.get(tuple(keys[:n]))
            if line is not None:
                return f"{self.path}:{line}"
        return self.path


def dotted(path: Path) -> str:
    """("launch", "nnodes") -> "launch.nnodes"; ("inject", 2) -> "inject[2]"."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _walk(node, path: Path, lines: dict, src: str, seen: set) -> None:
    if id(node) in seen:          # aliases share nodes; a recursive alias would loop forever
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict = {}
        for knode, vnode in node.value:
            if knode.tag == "tag:yaml.org,2002:merge":   # `<<: *base`: keys come from the alias
                _walk(vnode, path, lines, src, seen)
                continue
            key = knode.value if isinstance(knode, yaml.ScalarNode) else repr(knode.value)
            line = knode.start_mark.line + 1
            if key in first:
                raise ConfigError(dotted(path + (key,)), f"duplicate key (first set on line "
                                  f"{first[key]})", "keep only one of them", f"{src}:{line}")
            first[key] = line
            lines.setdefault(path + (key,), line)
            _walk(vnode, path + (key,), lines, src, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.setdefault(path + (i,), item.start_mark.line + 1)
            _walk(item, path + (i,), lines, src, seen)


def load_yaml(path: str, source: str = "--config") -> YamlDoc:
    """Read and parse `path`; `source` names where the path itself came from, for errors."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError("config", f"cannot read {path!r}: {e.strerror or e}",
                          "check the path given to --config / LETO_CONFIG", source) from None
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        lines: dict = {}
        if node is not None:
            _walk(node, (), lines, path, set())
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError("config", f"YAML syntax error: {problem}",
                          "fix the YAML (indentation, quoting, ':' after keys)", where) from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"the document is a {type(data).__name__}, not a mapping",
                          "write sections at the top level: launch:, rendezvous:, logs:, "
                          "recovery:, inject:", f"{path}:1")
    return YamlDoc(path, data, lines)
