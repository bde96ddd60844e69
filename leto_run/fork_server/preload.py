"""What the fork server imports after torch for one job, decided from the training script's code.

Why: the server's extra imports are paid once per job and saved in every worker that would
import them itself: torch._dynamo (~1.7 CPU-s; torch.optim's optimizers, torch.utils.checkpoint
and DDP import it when they are used) and torch.distributed.checkpoint (~1 CPU-s; DCP scripts,
and leto_runtime's checkpoints).  A script that uses neither -- one on leto_runtime's own
optimizer, a test's small script -- would pay them for nothing, and its first workers would
start that much later (docs/ARCHITECTURE.md, "The preload after torch"; the measurements in
docs/BENCHMARKS.md, "The fork server").

The decision reads source, runs nothing (`ast`): the script's file and the modules beside it
that it imports (recursively, a bounded number).  A module is wanted when some code names a
*trigger* of it (a dotted name under one of `TRIGGERS`, through any import alias, or a string
that starts with one; `.compile` of anything not from the standard library counts for dynamo).
The script's directory is that of its real path (as the interpreter's sys.path[0]), and a file
there shadows a library module of its name.  Whatever it cannot see through preloads
everything, as before the decision existed: ``-m`` or ``-c`` workers, a source it cannot read
or parse, more than `MAX_FILES` files, `MAX_BYTES` or `MAX_S` of parsing, an import of any
module that is neither the standard library, torch, leto_runtime nor a file beside the script,
a ``*`` import from outside the standard library, and code that imports or runs what the names
do not show (exec, eval, __import__, importlib.import_module, runpy, getattr on torch).  A wrong
guess costs CPU, never correctness: a worker imports what it uses.

Calling contract: `plan(argv, cwd, checkpoints)` -> `Plan(modules, reason)`; pure but for
reading the script's files.  `argv` is a worker's command line (`worker_cmd.worker_argv`).
"""
from __future__ import annotations

import ast
import os
import stat
import sys
import time
from dataclasses import dataclass

from leto_run.fork_server.server import ALSO_PRELOAD as ALL

DYNAMO, DCP = ALL
# Dotted names whose use imports the module (measured on torch 2.13: an optimizer's
# construction, torch.utils.checkpoint, DDP's forward); the parents of a trigger name none.
TRIGGERS = {
    DYNAMO: ("torch.optim", "torch.compile", "torch._dynamo", "torch.compiler", "torch.export",
             "torch.nn.parallel", "torch.utils.checkpoint", "torch.distributed.fsdp",
             "torch.distributed.tensor", "torch.distributed.algorithms",
             "torch.distributed.pipelining", "torch.distributed._composable",
             "torch.distributed.checkpoint"),
    DCP: ("torch.distributed.checkpoint",),
}
# Beside torch: what the checked code may import without making it opaque (no torch in them).
_KNOWN_FREE = ("numpy",)
# Bounds on what the agent reads before its first worker (parsing: ~0.2 s per MiB of ordinary
# code, more for dense expressions); past them the code is opaque.
MAX_FILES, MAX_BYTES, MAX_S = 64, 1 << 20, 1.0


@dataclass(frozen=True)
class Plan:
    modules: tuple[str, ...]      # what the server imports after torch, in `ALL`'s order
    reason: str                   # why (the server's spawn event records it)


def plan(argv: list[str], cwd: str, checkpoints: bool) -> Plan:
    """The preload of a job whose workers run `argv` in `cwd`; `checkpoints`: the job writes
    leto_runtime checkpoints (checkpoint.dir is set).  Never raises (it runs in the agent
    before anything starts): whatever goes wrong preloads everything."""
    if len(argv) < 3 or argv[1] != "-u" or argv[2].startswith("-"):
        return Plan(ALL, "the workers do not run a script file (-m, -c or --no-python)")
    try:
        return _plan(os.path.join(cwd, argv[2]), checkpoints)
    except Exception as e:          # noqa: BLE001 -- a guess, never a reason to fail a job
        return Plan(ALL, f"the script's code could not be read ({type(e).__name__})")


def _plan(script: str, checkpoints: bool) -> Plan:
    names, why = _scan(script)
    if why is not None:
        return Plan(ALL, why)
    named = sorted({t for m in ALL for t in TRIGGERS[m] if any(_under(n, t) for n in names)})
    ckpt = checkpoints and any(_under(n, "leto_runtime") for n in names)
    want = tuple(m for m in ALL if set(named) & set(TRIGGERS[m]) or (m == DCP and ckpt))
    if not want:
        return Plan((), "the script's code names none of the triggers")
    return Plan(want, "the script's code names " + ", ".join(
        named + (["leto_runtime with checkpoints"] if ckpt else [])))


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _scan(script: str) -> tuple[set[str], str | None]:
    """Every dotted name the script and its local modules use; or why they cannot be seen."""
    names: set[str] = set()
    # the interpreter puts the directory of the script's real path first on sys.path
    script = os.path.realpath(script)
    todo, seen, budget = [script], set(), [MAX_BYTES]
    root, t0 = os.path.dirname(script), time.monotonic()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if len(seen) > MAX_FILES or time.monotonic() - t0 > MAX_S:
            return names, f"the script's local code is more than {MAX_FILES} files or {MAX_S} s"
        tree, why = _parse(path, budget)
        if tree is None:
            return names, why
        rel = os.path.relpath(os.path.dirname(path), root)
        found, imports, opaque = _names(tree, [] if rel == os.curdir else rel.split(os.sep))
        if opaque:
            return names, f"{path} {opaque}"
        names |= found
        for mod in imports:
            files = _local_files(root, mod)     # first: a local file shadows the library
            top = mod.split(".")[0]
            if files is not None:
                todo.extend(files)
            elif top not in sys.stdlib_module_names and \
                    top not in ("torch", "leto_runtime", *_KNOWN_FREE):
                return names, f"the script imports {mod!r}, which is not beside it"
    return names, None


def _parse(path: str, budget: list[int]) -> tuple[ast.AST | None, str]:
    """The file's syntax tree, its size taken from `budget[0]`; or why not.  Only a regular
    file is read (O_NONBLOCK, checked after the open: a FIFO or a device never blocks us)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return None, f"{path} cannot be read as Python ({type(e).__name__})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{path} is not a regular file"
        if st.st_size > budget[0]:
            return None, f"the script's local code is larger than {MAX_BYTES >> 20} MiB"
        budget[0] -= st.st_size
        with os.fdopen(fd, "rb", closefd=False) as f:
            return ast.parse(f.read(budget[0] + st.st_size + 1), path), ""
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return None, f"{path} cannot be read as Python ({type(e).__name__})"
    finally:
        os.close(fd)


def _local_files(root: str, mod: str) -> list[str] | None:
    """The files beside the script that `import mod` runs (each package's __init__ and the
    module), or None when `mod` is not there.  A directory without __init__.py is a namespace
    package: nothing to read, its modules below."""
    parts, files, base = mod.split("."), [], root
    for i, part in enumerate(parts):
        pkg, single = os.path.join(base, part), os.path.join(base, part + ".py")
        if os.path.isfile(os.path.join(pkg, "__init__.py")):
            files.append(os.path.join(pkg, "__init__.py"))
            base = pkg
        elif os.path.isfile(single):
            files.append(single)
            break
        elif os.path.isdir(pkg):
            base = pkg
        elif i == 0:
            return None
        else:
            break               # `from pkg import name`: a name, not a module
    return files


def _names(tree: ast.AST, package: list[str]) -> tuple[set[str], set[str], str | None]:
    """(the dotted names `tree` uses, through its import aliases; the modules it imports,
    relative imports made absolute: `package` is the file's package below the script's
    directory; why the code is opaque -- imports or code the names do not show -- or None)."""
    alias: dict[str, str] = {}
    names: set[str] = set()
    imports: set[str] = set()
    opaque: str | None = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                imports.add(a.name)
                names.add(a.name)
                top = a.name.split(".")[0]
                alias[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                up = node.level - 1
                base = package[:len(package) - up] if up <= len(package) else []
                mod = ".".join([*base, mod] if mod else base)
            if mod:
                imports.add(mod)
                names.add(mod)
            for a in node.names:
                if a.name == "*" and mod.split(".")[0] not in sys.stdlib_module_names:
                    opaque = f"imports * from {mod!r}"
                full = f"{mod}.{a.name}" if mod else a.name
                names.add(full)
                imports.add(full)            # `from pkg import mod` runs pkg/mod.py
                alias[a.asname or a.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            opaque = opaque or _dynamic(node, alias)
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain is not None:
                head, _, rest = chain.partition(".")
                full = alias.get(head, head) + ("." + rest if rest else "")
                names.add(full)
                if node.attr == "compile" and full.split(".")[0] not in sys.stdlib_module_names:
                    names.add("torch.compile")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.startswith("torch."):
            names.add(node.value)
    return names, imports, opaque


def _dynamic(call: ast.Call, alias: dict[str, str]) -> str | None:
    """Why `call` may import or run code the names do not show (None: it does not)."""
    f = call.func
    if isinstance(f, ast.Name) and f.id in ("exec", "eval", "__import__"):
        return f"calls {f.id}()"
    chain = _chain(f) if isinstance(f, ast.Attribute) else None
    if chain is not None:
        head, _, rest = chain.partition(".")
        full = alias.get(head, head) + ("." + rest if rest else "")
        if _under(full, "runpy") or full in ("importlib.import_module", "importlib.__import__"):
            return f"calls {full}()"
    if isinstance(f, ast.Name) and f.id == "getattr" and call.args:
        base = _chain(call.args[0]) if isinstance(call.args[0], ast.Attribute) else (
            call.args[0].id if isinstance(call.args[0], ast.Name) else None)
        if base is not None:
            head, _, rest = base.partition(".")
            if _under(alias.get(head, head) + ("." + rest if rest else ""), "torch"):
                return "looks up an attribute of torch by getattr()"
    return None


def _chain(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    if parts and parts[0] == "compile":
        return "<expr>.compile"        # model(...).compile(): not from the standard library
    return None
