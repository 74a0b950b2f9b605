"""Every AUTOSEL_* environment variable, read and validated in this one place."""

from __future__ import annotations

import difflib
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from autosel import state
from autosel.errors import ConfigError
from autosel.platforms import EXECUTION_MODES
from autosel.spec import KernelBackend

log = logging.getLogger(__name__)

TUNE_MODES = ("auto", "off", "force")
LOG_LEVELS = ("debug", "info", "warning", "error")
MATCH_MODES = ("exact", "device", "arch")
SWITCHES = ("0", "1", "off", "on")

VARIABLES = {
    "AUTOSEL_DB": "path of the writable user tuning DB (default: the user cache folder)",
    "AUTOSEL_DB_PATH": "read-only shipped DBs, files or folders, separated by ':'",
    "AUTOSEL_TUNE": "auto (tune on a miss), off (never time at run time), force (re-tune)",
    "AUTOSEL_BACKEND": "force a backend: 'triton' for every op, or 'op=backend,op2=backend'",
    "AUTOSEL_MODE": "execution mode for selection outside graph capture: eager or graph",
    "AUTOSEL_BUDGET_S": "time budget per op when tuning at run time, in seconds",
    "AUTOSEL_RECORD": "append each dispatched op's shape bucket to this JSON Lines file",
    "AUTOSEL_LOG": "log level of the autosel logger: debug, info, warning, error",
    "AUTOSEL_MATCH": "which stored decisions count: exact (this device and versions), device (also other versions), "
                     "arch (also another device model of this arch)",
    "AUTOSEL_CHECK_RANKS": "0/off (default) or 1/on: with several ranks, each rank also looks up its own stored "
                           "decision and logs where it differs from rank 0's",
    "AUTOSEL_FAST_LAUNCH": "1/on (default) or 0/off: autosel's Triton kernels launch from C after their first call; "
                           "off, every call goes through Triton's own launch (read when the built-in ops load)",
}


@dataclass(frozen=True)
class Settings:
    db: Path
    db_path: tuple[Path, ...]
    tune: str
    forced_backend: KernelBackend | None
    forced_per_op: tuple[tuple[str, KernelBackend], ...]
    mode: str | None
    budget_s: float
    record: Path | None
    log_level: str | None
    match: str = "exact"  # AUTOSEL_MATCH: exact, device (other versions too), arch (other models of the arch too)
    check_ranks: bool = False  # AUTOSEL_CHECK_RANKS: compare each rank's own stored decision with rank 0's

    def forced_backend_for(self, op: str) -> tuple[KernelBackend | None, bool]:
        """(backend, per_op): a per-op force wins over the global one."""
        for name, backend in self.forced_per_op:
            if name == op:
                return backend, True
        return self.forced_backend, False


def default_db_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("autosel")) / "tuning.db"


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...], default: str | None) -> str | None:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in allowed:
        raise ConfigError(f"{name}={env[name]!r} is not valid; allowed values: {', '.join(allowed)}")
    return raw


def _backend(name: str, text: str) -> KernelBackend:
    try:
        return KernelBackend.parse(text.strip())
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _parse_forced(env: Mapping[str, str]):
    raw = env.get("AUTOSEL_BACKEND", "").strip()
    if not raw:
        return None, ()
    if "=" not in raw:
        return _backend("AUTOSEL_BACKEND", raw), ()
    per_op = []
    for item in filter(None, (p.strip() for p in raw.split(","))):
        op, sep, backend = item.partition("=")
        if not (sep and op.strip() and backend.strip()):
            raise ConfigError(
                f"AUTOSEL_BACKEND item {item!r} is not 'op=backend'; write e.g. "
                "AUTOSEL_BACKEND='layernorm.rmsnorm=triton,gemm.mm=torch'"
            )
        per_op.append((op.strip(), _backend("AUTOSEL_BACKEND", backend)))
    return None, tuple(per_op)


def nearest_ops(op: str, registered: Sequence[str]) -> str:
    """"did you mean a.b or a.c?" naming the registered ops nearest to a misspelt one, or "" when none is near."""
    near = difflib.get_close_matches(op, registered, n=3)
    return f"did you mean {' or '.join(near)}?" if near else ""


def unknown_op_problems(ops: Iterable[str], registered: Sequence[str]) -> list[str]:
    """A sentence per AUTOSEL_BACKEND op that is not in `registered`, naming the registered ops nearest to it.
    Parsing cannot check this: plug-ins fill the registry after the environment is read."""
    problems = []
    for op in ops:
        if op not in registered:
            hint = nearest_ops(op, registered) or f"registered ops: {', '.join(registered) or 'none'}"
            problems.append(f"AUTOSEL_BACKEND names op {op!r}, which is not registered here ({hint})")
    return problems


def check_forced_ops(settings: Settings, registered: Sequence[str]) -> None:
    """A ConfigError when AUTOSEL_BACKEND forces a backend for an op that is not registered (a typo forces nothing)."""
    problems = unknown_op_problems((op for op, _ in settings.forced_per_op), registered)
    if problems:
        raise ConfigError("; ".join(problems))


DEFAULT_BUDGET_S = 30.0


def _budget(env: Mapping[str, str]) -> float:
    raw = env.get("AUTOSEL_BUDGET_S", "").strip()
    if not raw:
        return DEFAULT_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value > 0):  # nan or inf: a budget that never ends
        raise ConfigError(f"AUTOSEL_BUDGET_S={raw!r} is not a positive finite number of seconds; "
                          "e.g. AUTOSEL_BUDGET_S=30")
    return value


def _path(name: str, raw: str) -> Path:
    """A path from a variable, with ~ expanded; a name no file system takes is a ConfigError, not an OSError later."""
    try:
        path = Path(raw).expanduser()
    except RuntimeError:  # ~nosuchuser
        raise ConfigError(f"{name}={raw!r}: there is no home folder for {raw.split(os.sep)[0]!r}; write the path "
                          "without ~, or with an existing user's ~name") from None
    if "\0" in raw:
        raise ConfigError(f"{name}={raw!r} contains a NUL character; set it to a file path")
    if raw.startswith("file:"):  # an SQLite URI: taken as a relative path, it made a folder named "file:" here
        plain = raw[len("file:"):].split("?", 1)[0].removeprefix("//localhost").removeprefix("//")
        raise ConfigError(f"{name}={raw!r} is an SQLite URI; autosel takes a file path and opens it as it needs "
                          f"(read-only where it only reads): set {name}={plain or 'PATH'}, or "
                          f"{name}=./{raw} for a file whose name begins with 'file:'")
    try:
        longest = os.pathconf(next((str(p) for p in path.absolute().parents if p.exists()), "/"), "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    for part in path.parts:
        if len(os.fsencode(part)) > longest:
            raise ConfigError(f"{name}: the name {part[:40]!r}... is {len(os.fsencode(part))} bytes long, over the "
                              f"file system's {longest}; choose a shorter file name")
    return path


def _path_list(raw: str) -> list[str]:
    """AUTOSEL_DB_PATH's items. An SQLite URI ("file:/x.db") is kept whole, for _path to refuse by name: split at
    its ':' it read as a file "file" that does not exist and a path without the URI's prefix."""
    items = raw.split(os.pathsep)
    for i, item in enumerate(items[:-1]):
        if item.strip() == "file" and os.pathsep == ":":
            return items[:i] + [f"file:{items[i + 1]}"] + items[i + 2:]
    return items


def log_level(env: Mapping[str, str] | None = None) -> str | None:
    """AUTOSEL_LOG alone, for the CLI, which reads the other variables per command."""
    return _choice(os.environ if env is None else env, "AUTOSEL_LOG", LOG_LEVELS, None)


def fast_launch(env: Mapping[str, str] | None = None) -> bool:
    """AUTOSEL_FAST_LAUNCH alone, for autosel.ops.triton_launch, which reads it when autosel's Triton kernels load:
    whether their calls after the first launch from C (the default) or all go through Triton's own launch."""
    return _choice(os.environ if env is None else env, "AUTOSEL_FAST_LAUNCH", SWITCHES, "1") in ("1", "on")


def record_path(env: Mapping[str, str] | None = None) -> Path | None:
    """AUTOSEL_RECORD alone, for get_kernel with an explicit backend, which the other variables do not concern (a
    bad AUTOSEL_TUNE made get_kernel(op, "torch") raise)."""
    raw = (os.environ if env is None else env).get("AUTOSEL_RECORD", "").strip()
    return _path("AUTOSEL_RECORD", raw) if raw else None


def read_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Parse the environment; a bad value is a ConfigError naming the variable and the allowed values."""
    env = os.environ if env is None else env
    forced, per_op = _parse_forced(env)
    db = env.get("AUTOSEL_DB", "").strip()
    shipped = tuple(_path("AUTOSEL_DB_PATH", p) for p in _path_list(env.get("AUTOSEL_DB_PATH", "")) if p.strip())
    return Settings(
        db=_path("AUTOSEL_DB", db) if db else default_db_path(),
        db_path=shipped,
        tune=_choice(env, "AUTOSEL_TUNE", TUNE_MODES, "auto"),
        forced_backend=forced,
        forced_per_op=per_op,
        mode=_choice(env, "AUTOSEL_MODE", EXECUTION_MODES, None),
        budget_s=_budget(env),
        record=record_path(env),
        log_level=log_level(env),
        match=_choice(env, "AUTOSEL_MATCH", MATCH_MODES, "exact"),
        check_ranks=_choice(env, "AUTOSEL_CHECK_RANKS", SWITCHES, "0") in ("1", "on"),
    )


def settings() -> Settings:
    """Settings of this moment (read on each use, so tests and long-lived processes see changes)."""
    result = read_settings()
    log_to_stderr(result.log_level)
    _warn_unknown_forced_ops(result)
    return result


class StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test runner swaps it)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def log_to_stderr(level: str | None) -> None:
    """AUTOSEL_LOG (or the CLI's -v): the `autosel` logger at `level`, with one StderrHandler however often this
    runs. A library adds no handler unasked (logging's advice), so without a level nothing changes; and without a
    handler of its own a script's AUTOSEL_LOG=debug showed nothing, since Python's last-resort output takes
    warnings only."""
    if not level:
        return
    logger = logging.getLogger("autosel")
    with state.process.locks.log_handler:
        if not any(isinstance(h, StderrHandler) for h in logger.handlers):
            handler = StderrHandler()
            handler.setFormatter(logging.Formatter("autosel: %(levelname)s: %(message)s"))
            logger.addHandler(handler)
    logger.setLevel(level.upper())


# The registered ops' names, read when AUTOSEL_BACKEND names an op: autosel.registry hands its reader in when it is
# imported (set_registered_ops), so that this module, which the registry's plug-ins read, never imports the registry.
_registered_ops: Callable[[], Iterable[str]] = tuple


def set_registered_ops(reader: Callable[[], Iterable[str]]) -> None:
    """Where settings() finds the registered ops' names to check AUTOSEL_BACKEND's against (autosel.registry's)."""
    global _registered_ops
    _registered_ops = reader


def _warn_unknown_forced_ops(result: Settings) -> None:
    """Selection warns once per AUTOSEL_BACKEND op that is not registered; it goes on (the entry forces nothing),
    since an engine may register its own ops later. `autosel doctor` reports it as blocking."""
    checked = state.process.memos.forced_ops_checked
    unchecked = {op for op, _ in result.forced_per_op} - checked
    if not unchecked:
        return
    checked.update(unchecked)
    for problem in unknown_op_problems(sorted(unchecked), list(_registered_ops())):
        log.warning("%s; this entry forces nothing until such an op is registered. Correct the op name in "
                    "AUTOSEL_BACKEND, or remove the entry", problem)
