"""Load a YAML job config and remember where every value came from (file and line).

`load_yaml(path)` returns a `YamlDoc`: the plain data (safe-loaded) plus the line of every key and
list item, so `ConfigError` can say `job.yaml:12`.  Duplicate keys -- which PyYAML silently
resolves to the last one -- are rejected here, because a duplicate usually means one of two
intended settings is being ignored.

Calling contract: raises `ConfigError` (key `config`, or the dotted key for duplicates) for an
unreadable file (missing, a directory, not UTF-8 text, larger than MAX_BYTES, not readable
within READ_TIMEOUT -- a pipe, e.g. `--config <(...)`, is read like a file), a YAML syntax error,
nesting deeper than MAX_DEPTH (a job config needs four levels; the parser recurses), a
duplicate key or a document that is not a mapping.  An empty document (or only comments)
loads as an empty mapping.  Plain scalars other than null load as text (`_Loader`), which the
key's converter reads exactly as the same text on the command line (`max_restarts: 010` is 10,
not YAML 1.1's octal 8; `1_0` is refused); `!!int` / `!!float` take decimal only.
"""
from __future__ import annotations

import os
import re
import select
import stat
import sys
import time
from dataclasses import dataclass, field

import yaml

from leto_run.errors import ConfigError

Path = tuple  # ("launch", "nnodes") or ("inject", 0)
MAX_BYTES = 1 << 20
MAX_DEPTH = 16
READ_TIMEOUT = 10.0
_FIX_PATH = "check the path given to --config / LETO_CONFIG"


class _Loader(yaml.SafeLoader):
    """SafeLoader whose plain scalars stay text (only null is typed), so a value in the file
    means exactly what the same text means on the command line or in the environment: the
    key's converter (`leto_run.config_conv`, the CLI's) reads it with the CLI's grammar.

    PyYAML's YAML 1.1 resolvers read `010` as 8 (octal), `1_0` as 10, `0x10` as 16, `1:4` as 64
    (base 60), `yes`/`on` as true, `2026-01-02` as a date, and `standalone: 1` or `id: 10` as
    ints that a switch or a name refused -- while `--max-restarts 010` is 10, `1_0` is refused
    and `PET_STANDALONE=1` is true.  Quoting never changes a value here, as on a command line."""


# YAML's null (`~`, `null`, empty) still means "the key's default"; `<<` still merges.
_Loader.yaml_implicit_resolvers = {}
_Loader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"),
                              ["~", "n", "N", ""])
_Loader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"])


class _BadScalar(yaml.constructor.ConstructorError):
    """A scalar refused with the key's fix (the loader names the key from the line)."""

    def __init__(self, problem: str, fix: str, mark):
        super().__init__(None, None, problem, mark)
        self.fix = fix


_DECIMAL = re.compile(r"[-+]?[0-9]+")
_NUMBER_FIX = "write the number in decimal digits, as on the command line (e.g. 10)"


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    """An explicit `!!int`: decimal only, as the CLI (PyYAML's reads `!!int 010` as octal 8),
    refusing what `int()` would (past `sys.get_int_max_str_digits()` digits) with the line;
    shorter ones reach the config, whose bounds name the key's range."""
    text = str(node.value).strip()
    if not _DECIMAL.fullmatch(text):
        raise _BadScalar(f"{text!r} is not a decimal integer (YAML 1.1 octal, hex, binary, "
                         "base-60 and 1_000 forms are not read)", _NUMBER_FIX, node.start_mark)
    digits = len(text.lstrip("+-"))
    if 0 < sys.get_int_max_str_digits() < digits:
        raise _BadScalar(f"an integer of {digits} digits is too large",
                         "write a number within the key's range (see configs/full.yaml)",
                         node.start_mark)
    return int(text)


def _construct_float(loader: _Loader, node: yaml.ScalarNode) -> float:
    """An explicit `!!float`: text as the CLI reads it (`float()`, no `_`, no base 60)."""
    text = str(node.value).strip()
    if "_" in text or ":" in text:
        raise _BadScalar(f"{text!r} is not a decimal number", _NUMBER_FIX, node.start_mark)
    return yaml.SafeLoader.construct_yaml_float(loader, node)


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


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


def _read(path: str, source: str) -> str:
    """The file's text: bounded in size and time, UTF-8 only."""
    def fail(problem: str, fix: str = _FIX_PATH) -> ConfigError:
        return ConfigError("config", f"{path!r}: {problem}", fix, source)
    try:
        if stat.S_ISDIR(os.stat(path).st_mode):
            raise fail("is a directory, not a YAML file",
                       "pass the job's YAML file, e.g. configs/minimal.yaml")
        # Non-blocking: opening a FIFO must not wait for a writer; reads wait in select.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise fail(f"cannot read it: {e.strerror or e}") from None
    chunks: list[bytes] = []
    size, deadline = 0, time.monotonic() + READ_TIMEOUT
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise fail(f"nothing more to read for {READ_TIMEOUT:g} s (a pipe nobody writes?)")
            if not select.select([fd], [], [], left)[0]:
                continue
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            except OSError as e:
                raise fail(f"cannot read it: {e.strerror or e}") from None
            if not data:
                break
            size += len(data)
            if size > MAX_BYTES:
                raise fail(f"is larger than {MAX_BYTES >> 20} MiB, not a job config",
                           "pass the job's YAML file (a few KiB)")
            chunks.append(data)
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}; a binary "
                   "file?)", "pass a YAML text file, e.g. configs/minimal.yaml") from None


def _check_depth(text: str, path: str) -> None:
    """Refuse deep nesting from the parser's events, before the recursive composer sees it."""
    depth = 0
    for ev in yaml.parse(text, Loader=_Loader):
        if isinstance(ev, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError("config", f"nesting deeper than {MAX_DEPTH} levels",
                                  "a job config has sections, keys and short lists: remove the "
                                  "extra nesting", f"{path}:{ev.start_mark.line + 1}")
        elif isinstance(ev, yaml.CollectionEndEvent):
            depth -= 1


def load_yaml(path: str, source: str = "--config") -> YamlDoc:
    """Read and parse `path`; `source` names where the path itself came from, for errors."""
    text = _read(path, source)
    loader = None
    lines: dict = {}
    try:
        _check_depth(text, path)
        loader = _Loader(text)
        node = loader.get_single_node()
        if node is not None:
            _walk(node, (), lines, path, set())
        data = loader.construct_document(node) if node is not None else None
    except yaml.reader.ReaderError as e:
        ch = chr(e.character) if isinstance(e.character, int) else e.character
        raise ConfigError("config", f"character {ch!r} at offset {e.position} "
                          "is not allowed in YAML", "remove it (is this a text file?)",
                          path) from None
    except _BadScalar as e:
        line = e.problem_mark.line + 1
        keys = [k for k, n in lines.items() if n == line]
        raise ConfigError(dotted(max(keys, key=len)) if keys else "config", e.problem,
                          e.fix, f"{path}:{line}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError("config", f"YAML syntax error: {problem}",
                          "fix the YAML (indentation, quoting, ':' after keys)", where) from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"the document is a {type(data).__name__}, not a mapping",
                          "write sections at the top level: launch:, rendezvous:, logs:, "
                          "recovery:, inject:", f"{path}:1")
    return YamlDoc(path, data, lines)
