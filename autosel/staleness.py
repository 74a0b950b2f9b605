"""Whether a stored decision is still this machine's answer: the fingerprint of what a decision was measured on
(the op's definition and each candidate's code), and the one rule, used by selection, `show` and `check`, that
judges a stored row by it, or by the older checks for rows stored before fingerprints were kept.

A fingerprint is a hash of source text and constants, read from the files without importing anything and cached
per process (state.process.derived; clear_cache() or `clear()` forgets), so a check at start-up compares stored
hashes instead of rebuilding what they describe."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import logging
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from autosel import state
from autosel.decisions import Decision, bucket_text, parse_bucket, version_diff, versions_hash
from autosel.platforms import PlatformInfo, key_fields
from autosel.spec import KernelSpec, OpDefinition

log = logging.getLogger(__name__)

# The parts of an op's definition a fingerprint holds; a kernel's part is KERNEL + its backend name.
SHAPES, BUCKET, CHECK, KERNEL = "shapes", "bucket", "check", "kernel:"
_WHAT = {SHAPES: "the op's representative shapes", BUCKET: "the op's bucket function",
         CHECK: "the op's tolerances or reference"}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- code identity: a function's source and that of what it uses in its own package ------------------------------

@dataclass(frozen=True)
class _Statement:
    """One top-level statement of a source file: its lines (1-based, inclusive)."""

    first: int
    last: int


@dataclass
class _Module:
    """One source file split into its top-level statements, indexed by the names they bind, with its imports."""

    lines: list[str]
    statements: list[_Statement] = field(default_factory=list)
    defs: dict[str, list[_Statement]] = field(default_factory=dict)  # name -> statements binding it or its attributes
    imports: dict[str, str] = field(default_factory=dict)  # local name -> "module" or "module:attr"
    _trees: dict[_Statement, ast.Module | None] = field(default_factory=dict)

    def text(self, statement: _Statement) -> str:
        """A statement's source without blank lines, comment lines or indentation: what it does, not where."""
        lines = self.lines[statement.first - 1: statement.last]
        return "\n".join(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))

    def tree(self, statement: _Statement) -> ast.Module | None:
        if statement not in self._trees:
            try:
                self._trees[statement] = ast.parse("\n".join(self.lines[statement.first - 1: statement.last]))
            except (SyntaxError, ValueError):
                self._trees[statement] = None
        return self._trees[statement]


_OPENS = re.compile(r"(?:async\s+def|def|class)\s+(\w+)")
_BINDS = re.compile(r"(\w+(?:\s*,\s*\w+)*)\s*(?:[.\[:]|[-+*/|&@%^]?=(?!=))")
_KEYWORDS = {"if", "elif", "else", "for", "while", "try", "except", "finally", "with", "assert", "del", "pass",
             "raise", "return", "global", "nonlocal", "match", "case", "print", "import", "from"}


def _parse(path: str, module: str) -> _Module | None:
    """The file split at its top-level statements by their lines alone: a line that starts at column 0, outside a
    string and a bracket's closing line, starts one, and decorators join the def they decorate. Only the statements
    a fingerprint follows are parsed (a whole file's ast.parse cost tens of milliseconds at start-up)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        log.debug("no code identity for %s (%s): %s", module, path, exc)
        return None
    parsed = _Module(lines)
    starts: list[int] = []
    in_string, decorated = False, False
    for number, line in enumerate(lines, 1):
        opens_here = not in_string and line[:1] not in ("", " ", "\t", "#", ")", "]", "}")
        if opens_here and not decorated:
            starts.append(number)
        if opens_here:
            decorated = line.startswith("@")
        if ('"""' in line or "'''" in line) and (line.count('"""') + line.count("'''")) % 2:
            in_string = not in_string
    ends = [n - 1 for n in starts[1:]] + [len(lines)]
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for first, last in zip(starts, ends):
        while last > first and (not lines[last - 1].strip() or lines[last - 1].lstrip().startswith("#")):
            last -= 1
        statement = _Statement(first, last)
        parsed.statements.append(statement)
        head = next((line for line in lines[first - 1: last] if not line.startswith("@")), lines[first - 1])
        if head.startswith(("import ", "from ")):
            _index_imports(parsed, statement, package)
        elif match := _OPENS.match(head):
            parsed.defs.setdefault(match.group(1), []).append(statement)
        elif (match := _BINDS.match(head)) and match.group(1).split(",")[0].strip() not in _KEYWORDS:
            for name in match.group(1).split(","):
                parsed.defs.setdefault(name.strip(), []).append(statement)
    return parsed


def _index_imports(parsed: _Module, statement: _Statement, package: str) -> None:
    tree = parsed.tree(statement)
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.Import):
            for alias in node.names:
                parsed.imports[alias.asname or alias.name.partition(".")[0]] = (
                    alias.name if alias.asname else alias.name.partition(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for alias in node.names:
                parsed.imports[alias.asname or alias.name] = f"{base}:{alias.name}"


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


class CodeIdentities:
    """The identities of code, from source files read once per process: what it has read and computed is
    `derived` (state.process.derived at each use: clear_cache() and a test's fresh state start afresh)."""

    @property
    def derived(self) -> state.Derived:
        return state.process.derived

    def _module(self, name: str) -> _Module | None:
        sources = self.derived.sources
        if name not in sources:
            sources[name] = (_parse(path, name) if (path := _source_path(name)) else None)
        return sources[name]

    def _names_module(self, name: str) -> bool:
        """Whether `name` is a module; asked of a package's names only, since find_spec imports the parent."""
        is_module = self.derived.is_module
        if name not in is_module:
            parent = _source_path(name.rpartition(".")[0])
            is_module[name] = bool(parent and parent.endswith("__init__.py") and _source_path(name))
        return is_module[name]

    def of_target(self, module: str, attr: str) -> str | None:
        """The identity of "module:attr" (a top-level name, or the first part of a dotted one); None where its
        source cannot be read (a compiled extension, a module built at run time)."""
        key = ("target", module, attr.partition(".")[0])
        derived = self.derived
        with derived.lock:
            if key not in derived.identities:
                derived.identities[key] = self._closure(module, [attr.partition(".")[0]], None)
            return derived.identities[key]

    def of_function(self, fn: Callable[..., Any]) -> str | None:
        """The identity of a function object (a bucket function, a lambda): the top-level statement its code starts
        in, and what that uses; None for a builtin or a function without readable source."""
        code = getattr(fn, "__code__", None)
        module = getattr(fn, "__module__", None)
        if code is None or not module:
            return None
        key = ("function", module, code.co_firstlineno, code.co_name)
        derived = self.derived
        with derived.lock:
            if key not in derived.identities:
                parsed = self._module(module)
                node = None if parsed is None else next(
                    (s for s in parsed.statements if s.first <= code.co_firstlineno <= s.last), None)
                derived.identities[key] = None if node is None else self._closure(module, [], node)
            return derived.identities[key]

    def _closure(self, module: str, names: list[str], start: _Statement | None) -> str | None:
        """A hash of the statements binding `names` in `module` (or of `start`), and, transitively, of every
        top-level statement of the same package's modules that they name."""
        top = module.partition(".")[0]
        parsed = self._module(module)
        if parsed is None:
            return None
        seen: set[tuple[str, _Statement]] = set()
        parts: list[str] = []
        pending: list[tuple[str, _Statement]] = [(module, start)] if start is not None else []
        for name in names:
            if name not in parsed.defs:
                return None  # bound some other way (a loop, a star import): nothing to hash it by
            pending += [(module, node) for node in parsed.defs[name]]
        while pending:
            where, node = pending.pop()
            if (where, node) in seen:
                continue
            seen.add((where, node))
            source = self._module(where)
            parts.append(f"{where}\n{source.text(node)}")
            pending += self._used(where, source, node, top)
        return _digest("\n\n".join(sorted(parts)))

    def _used(self, module: str, parsed: _Module, node: _Statement, top: str) -> list[tuple[str, _Statement]]:
        """The top-level statements, in `module` or another module of the package `top`, that `node` names."""
        found: list[tuple[str, _Statement]] = []
        tree = parsed.tree(node)
        for sub in ast.walk(tree) if tree is not None else ():
            if isinstance(sub, ast.Name):
                if sub.id in parsed.defs:
                    found += [(module, s) for s in parsed.defs[sub.id]]
                elif sub.id in parsed.imports:
                    found += self._imported(parsed.imports[sub.id], None, top)
            elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in parsed.imports:
                found += self._imported(parsed.imports[sub.value.id], sub.attr, top)
        return found

    def _imported(self, origin: str, attr: str | None, top: str) -> list[tuple[str, _Statement]]:
        module, _, name = origin.partition(":")
        if module.partition(".")[0] != top:
            return []  # another package's code: its version is in the decision's key (and it is never imported here)
        if name and self._names_module(f"{module}.{name}"):  # `from pkg import submodule`
            module, name = f"{module}.{name}", ""
        name = name or attr
        if not name:
            return []
        parsed = self._module(module)
        return [] if parsed is None else [(module, s) for s in parsed.defs.get(name, ())]


def _source_path(module: str) -> str | None:
    """The .py file of `module`, found without importing it (its parent package is imported, as find_spec does)."""
    loaded = sys.modules.get(module)
    path = getattr(loaded, "__file__", None) if loaded is not None else None
    if path is None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError, AttributeError):
            return None
        path = spec.origin if spec is not None else None
    return path if path and path.endswith(".py") else None


identities = CodeIdentities()


# --- fingerprints ---------------------------------------------------------------------------------------------

def kernel_identity(spec: KernelSpec) -> str | None:
    """The identity of a candidate's code: its source where it is Python of its own (autosel's kernels, an engine's
    own); None for a function of a package it requires (a vendor's compiled kernel), whose version the decision's
    key holds already, and for code whose source cannot be read."""
    module, _, attr = spec.target.partition(":")
    if module.partition(".")[0] in {p.partition(".")[0] for p in spec.requires}:
        return None
    return identities.of_target(module, attr)


def definition_parts(definition: OpDefinition, platform: Any) -> dict[str, str]:
    """The fingerprint's parts that describe the op's definition on `platform` (its shapes depend on it)."""
    parts: dict[str, str] = {}
    try:
        parts[SHAPES] = _digest(json.dumps(definition.shapes_for(platform), sort_keys=True))
    except Exception as exc:  # a plug-in's shapes function: tuning reports it; the fingerprint leaves it out
        log.debug("op %r: no shapes for its fingerprint: %s", definition.op, exc)
    if definition.bucket is None:
        parts[BUCKET] = "none"
    elif (bucket := identities.of_function(definition.bucket)) is not None:
        parts[BUCKET] = bucket
    reference = definition.reference
    code = identities.of_function(reference) if callable(reference) and hasattr(reference, "__code__") else ""
    parts[CHECK] = _digest(f"{definition.checked_with}\n{code or ''}")
    return parts


def fingerprint(definition: OpDefinition | None, specs: Iterable[KernelSpec], platform: Any) -> dict[str, str]:
    """What a decision of `definition` among `specs` on `platform` is measured on: the op's parts and one part per
    candidate whose code autosel can read."""
    parts = {} if definition is None else definition_parts(definition, platform)
    for spec in specs:
        if (identity := kernel_identity(spec)) is not None:
            parts[KERNEL + spec.backend.value] = identity
    return parts


def platform_of_key(platform_key: str) -> PlatformInfo:
    """The platform a key describes (device type, arch and compute capability, normalised name, multiprocessor
    count): what the fingerprint's shapes are asked of, at a tune and when judged, so both ends ask the same
    question of an op's shapes function, and a row stored for another machine can be judged here."""
    device, arch, name, count = key_fields(platform_key)
    major = minor = None
    if arch.startswith("sm_") and arch[3:].isdigit() and len(arch) > 4:
        major, minor = int(arch[3:-1]), int(arch[-1])
    return PlatformInfo(device_type=device, cuda_arch_major=major, cuda_arch_minor=minor, arch=arch,
                        device_name=name if name != "unknown" else "",
                        multiprocessor_count=int(count) if count.isdigit() else 0)


def changed_parts(stored: dict[str, str], now: dict[str, str]) -> list[str]:
    """What differs between a stored fingerprint and today's, in words; parts only one side has are not judged (a
    backend not registered here, code whose source is not readable here)."""
    differ = [part for part in sorted(stored) if part in now and stored[part] != now[part]]
    return [_WHAT.get(part) or f"the {part[len(KERNEL):]} kernel's code" for part in differ]


# --- the stale rule -------------------------------------------------------------------------------------------

def version_staleness(decision: Decision, platform_key: str, versions: dict[str, str], eligible: list[str]
                      ) -> str | None:
    """Why a row is not this machine's key (platform key or version vector), or None. eligible: the op's backends
    eligible here, whose versions `versions` are; with none, no vector judges the row."""
    if decision.platform_key != platform_key:
        return f"tuned on {decision.platform_key}, this machine is {platform_key}"
    if eligible and decision.key.versions_hash != versions_hash(versions):
        return f"versions differ: {version_diff(decision.versions, versions)}"
    return None


def outdated(db, decision: Decision, layer, names: list[str], definition: OpDefinition | None,
             specs: Iterable[KernelSpec] = ()) -> str:
    """Why a stored op-level decision whose winner can run here is not this machine's answer now, or "": it never
    timed a backend eligible here (registered or installed since), its bucket rows run one that is not (gone
    since), it was checked with other tolerances or another reference than the op's now (`definition`), in graph
    mode on CUDA it was timed without reading the op's declared weights from memory, or what it was measured on
    changed: its fingerprint differs from today's (`specs`: the candidates registered here whose code it compares).
    A row stored before fingerprints were kept is judged instead by whether its bucket rows are keyed as the op's
    bucket function keys their shapes today, which builds inputs on the meta device (and imports torch._dynamo at the
    first arithmetic on meta tensors, about 1.5 s): `tools/build_tuning_db.py` fingerprints the shipped rows, so
    only such rows of a user's own older DB pay it."""
    if untimed := decision.untimed(names):
        return f"never timed {', '.join(untimed)}, eligible here since it was made"
    rows = db.buckets(decision, layer)
    gone = sorted({row.winner for row in rows} - set(names))
    if gone:
        return f"has bucket rows that run {', '.join(gone)}, not eligible here since it was made"
    if definition is not None and decision.checked_with and decision.checked_with != definition.checked_with:
        return f"was checked with {decision.checked_with}; the op is checked with {definition.checked_with} now"
    if _timed_from_the_l2(decision, definition):
        return ("was timed replaying one copy of its weights, which the L2 can hold; graph timing reads them from "
                "memory now (docs/TUNING.md section 2)")
    if decision.fingerprint:
        timed = {c.backend for c in decision.candidates}
        now = fingerprint(definition, [s for s in specs if not timed or s.backend.value in timed],
                          platform_of_key(decision.platform_key))
        if what := changed_parts(decision.fingerprint, now):
            return f"was measured on other code or definitions than run now ({', '.join(what)} changed since)"
        return ""
    if definition is not None and definition.bucket is not None:
        for row in rows:
            if (today := keyed_today(row, definition)) is not None:
                return (f"has bucket rows keyed otherwise than the op's bucket function has keyed their shapes since "
                        f"it was made (such as {row.bucket}, now {today})")
    return ""


def _timed_from_the_l2(decision: Decision, definition: OpDefinition | None) -> bool:
    """A graph-mode CUDA row of an op with declared weights, timed before graph timing read them from memory."""
    if not (definition is not None and definition.weights and decision.mode == "graph"
            and decision.method.startswith("cuda:")):
        return False
    # Imported only for such rows: the timing rules import statistics (with decimal and fractions), which a process
    # reading a CPU or eager decision at start-up has no other use for.
    from autosel.policy import WEIGHTS_FROM_MEMORY
    from autosel.timing import CudaGraphTimer, reads_weights

    return reads_weights(CudaGraphTimer) and WEIGHTS_FROM_MEMORY not in decision.method


def keyed_today(row: Decision, definition: OpDefinition) -> str | None:
    """The bucket the op's bucket function gives a row's first shape today, where that is not the row's (the
    function changed since the tune); None when it is the row's, or cannot be told (inputs built on the "meta"
    device, shapes without data, that the op's make_inputs or bucket function refuses; a bucket that is no bucket
    key, which selection ignores too). The rule for rows stored without a fingerprint."""
    shape = next((s.shape for c in row.candidates for s in c.shapes), None)
    if shape is None:
        return None
    try:
        stored = parse_bucket(row.bucket)
    except ValueError:  # no bucket key: selection leaves the row out too
        return None
    # Each shape's bucket as keyed_today last told it, by the op's functions: an op's eager and graph tables share
    # their shapes, and near matches (AUTOSEL_MATCH) judge several platforms' rows of them.
    meta_keys = state.process.derived.meta_keys
    cached = (definition.make_inputs, definition.bucket, json.dumps(shape, sort_keys=True))
    if cached not in meta_keys:
        try:
            meta_keys[cached] = tuple(definition.bucket(*definition.make_inputs(shape, "meta")))
        except Exception as exc:  # a user op's functions may not take meta tensors (or torch may be missing)
            log.debug("op %r: bucket of %s not told on meta tensors: %s", row.op, shape, exc)
            meta_keys[cached] = None
    key = meta_keys[cached]
    return bucket_text(key) if key is not None and key != stored else None


def clear() -> None:
    """Forget what this process has read and computed for staleness (tests that edit source files call it)."""
    state.process.derived = state.Derived()
