"""The tuning database: layered SQLite files of decisions with their evidence, safe under many processes."""

from __future__ import annotations

import importlib.resources
import logging
import os
import socket
import sqlite3
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from sqlite_utils import Database

from autosel import db_tools
from autosel.db_tools import (
    KEY_COLUMNS, OWN_TABLES, ROW_COLUMNS, SQLITE_MAGIC, Conflict, Corrupt, MergeReport, NotSQLite, connect,
    decision_row, export_decisions, header_application_id, identify, immediate, inspect, is_corrupt, merge, migrate,
    parse_row, read_decisions, ro_uri,
)
from autosel.config import DEFAULT_BUDGET_S
from autosel.decisions import OP_LEVEL_BUCKET, Decision, DecisionKey
from autosel.errors import DatabaseError
from autosel.platforms import near_rank

if TYPE_CHECKING:
    from autosel.config import Settings

__all__ = ["Conflict", "Layer", "MergeReport", "TuningDB", "export_decisions", "merge", "read_decisions"]

logger = logging.getLogger(__name__)

_warned: set[tuple[str, str]] = set()


def warn_once(path: object, condition: str, message: str) -> None:
    """One RuntimeWarning per (path, condition) per process: degraded but working, remedy in the sentence."""
    if (str(path), condition) not in _warned:
        _warned.add((str(path), condition))
        warnings.warn(message, RuntimeWarning, stacklevel=2)


@dataclass(frozen=True)
class Layer:
    """The state of one layer, for `autosel doctor` and `show`."""

    path: str  # ":memory:" for the in-memory fallback
    kind: str  # "user" | "shipped" | "memory"
    writable: bool
    schema_version: int | None
    rows: int
    problem: str | None


class _Open:
    """One open layer: its connection and what is known about it."""

    def __init__(self, path: str, kind: str, conn: sqlite3.Connection, *, writable: bool,
                 schema_version: int | None, problem: str | None = None, could_write: bool | None = None):
        """could_write: opened read-only for a command that only reads, whether selection could write the file."""
        self.path, self.kind, self.conn, self.writable = path, kind, conn, writable
        self.schema_version, self.problem, self.broken = schema_version, problem, False
        self.could_write = could_write
        self.db = Database(conn, execute_plugins=False) if writable else None

    def layer(self) -> Layer:
        try:
            rows = self.conn.execute("SELECT count(*) FROM decisions").fetchone()[0]
        except sqlite3.Error:
            rows = 0
        writable = self.could_write if self.could_write is not None else self.writable and not self.broken
        return Layer(self.path, self.kind, writable, self.schema_version, rows, self.problem)

    def select(self, where: str = "", params: Sequence = ()) -> list[tuple]:
        if self.broken:
            return []
        try:
            return self.conn.execute(
                f"SELECT {', '.join(ROW_COLUMNS)} FROM decisions {where} ORDER BY op, mode, bucket, platform_key",
                params).fetchall()
        except sqlite3.Error as exc:
            self.broken, self.problem = True, f"read failed: {exc}"
            remedy = ("remove it from AUTOSEL_DB_PATH" if self.kind == "shipped"
                      else "set AUTOSEL_DB (or --db) to another file")
            warn_once(self.path, "read", f"reading tuning DB {self.path} failed ({exc}); skipping it for the rest "
                      f"of this process. Run `autosel doctor` to check it, or {remedy}.")
            return []


def _memory(problem: str | None = None) -> _Open:
    conn = connect(":memory:")
    migrate(conn)
    return _Open(":memory:", "memory", conn, writable=True, schema_version=db_tools.SCHEMA_VERSION, problem=problem)


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _move_aside(path: Path, inode: int | None) -> Path | None:
    """Rename a corrupt file (and its -wal/-shm) to <name>.corrupt-<timestamp>; never delete it."""
    if inode is None or _inode(path) != inode:
        return None  # another process already moved it (and may have started a fresh one): leave that alone
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = path.with_name(f"{path.name}.corrupt-{stamp}"), 1
    while target.exists():
        target, n = path.with_name(f"{path.name}.corrupt-{stamp}-{n}"), n + 1
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return None
    for suffix in ("-wal", "-shm", "-journal"):
        side = Path(f"{path}{suffix}")
        if side.exists():
            os.rename(side, Path(f"{target}{suffix}"))
    return target


class _Interrupted(Exception):
    """A process was killed in a write transaction: a journal lies next to the file, whose header may be unwritten."""


def _inspect_file(path: Path, *, recover: bool = True) -> tuple[int, str, str]:
    """(user_version, written by, identify()'s kind) of an existing file; NotSQLite or Corrupt if it is not sound.

    recover: a process killed in a write transaction leaves a hot journal (or a WAL to recover) that a read-only
    connection cannot roll back (SQLITE_READONLY_ROLLBACK / _RECOVERY), and a new file's first page may not be
    written yet; let SQLite's own crash recovery run through a read-write connection that only reads, as any
    SQLite client opening the file would. Without it, a DB whose creator was killed stayed read-only (or was
    taken for a file that is not SQLite) in every later process."""
    # Check through a read-only connection first: closing a read-write one on a bad file would checkpoint
    # into it and delete its -wal, and the moved-aside copy must keep the bytes it had.
    for attempt in range(2):
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
        if attempt and not head:
            return 0, "unknown", "empty"  # rolled back to nothing: a new file
        if head != SQLITE_MAGIC:
            if not Path(f"{path}-journal").exists():
                raise NotSQLite("it is not an SQLite file (no SQLite header)")
            if not recover or attempt:
                raise _Interrupted("a process was killed while writing it")
        else:
            conn = connect(ro_uri(path, immutable=False), uri=True)
            try:
                version, written_by, _ = inspect(conn)
                return version, written_by, identify(conn)
            except sqlite3.Error as exc:
                if not (recover and _needs_recovery(exc)) or attempt:
                    raise
            finally:
                conn.close()
        logger.info("%s: recovering after a process that was killed while writing it", path)
        writer = connect(str(path))
        try:
            writer.execute("SELECT count(*) FROM sqlite_master").fetchone()  # rolls a hot journal back
        except sqlite3.Error as exc:
            logger.info("%s: recovery did not help: %s", path, exc)
        finally:
            writer.close()
    raise AssertionError("unreachable")


def _needs_recovery(exc: BaseException) -> bool:
    # Python 3.10 has no sqlite_errorname: the message of SQLITE_READONLY_ROLLBACK / _RECOVERY then tells.
    name = getattr(exc, "sqlite_errorname", "")
    return name.startswith("SQLITE_READONLY_") if name else "readonly database" in str(exc)


def _damaged_autosel(path: Path) -> bool:
    """Whether a damaged SQLite file is autosel's (its header's mark, or autosel's tables still listed), and so
    may be moved aside; a damaged file of anyone else's is left where it is."""
    if header_application_id(path) == db_tools.APPLICATION_ID:
        return True
    try:
        conn = connect(ro_uri(path, immutable=False), uri=True)
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            conn.close()
    except sqlite3.Error:
        return False
    return tables == OWN_TABLES


def _switch_to_wal(conn: sqlite3.Connection) -> None:
    """PRAGMA journal_mode = WAL, retried while busy: the switch does not wait through the busy timeout, so a
    process creating the DB next to another one (or next to one killed mid-creation) got "database is locked"
    and fell back to memory for good."""
    deadline = time.monotonic() + db_tools.BUSY_TIMEOUT_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _open_user(path: Path) -> list[_Open]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _readonly(path, f"cannot create folder {path.parent} ({exc.strerror or exc})")
    problem = None
    for attempt in range(2):
        inode, conn = _inode(path), None
        try:
            if path.is_file() and path.stat().st_size:
                version, written_by, kind = _inspect_file(path)
                if version > db_tools.SCHEMA_VERSION:
                    return _newer(path, version, written_by)
                if kind == "foreign":
                    return _readonly(path, "it is an SQLite file but not an autosel tuning DB; left untouched",
                                     ro=False)
            if path.exists() and not os.access(path, os.W_OK):
                return _readonly(path, "the file is read-only")
            conn = connect(str(path))
            if identify(conn) == "foreign":  # someone made it something else since we looked
                conn.close()
                return _readonly(path, "it is an SQLite file but not an autosel tuning DB; left untouched",
                                 ro=False)
            _switch_to_wal(conn)
            conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: a killed process loses nothing committed
            migrate(conn)
            return [_Open(str(path), "user", conn, writable=True, schema_version=db_tools.SCHEMA_VERSION,
                          problem=problem)]
        except (OSError, sqlite3.Error, Corrupt, _Interrupted) as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, (NotSQLite, _Interrupted)):
                return _readonly(path, f"{exc}; left untouched", ro=False)
            if not is_corrupt(exc) or attempt or not _damaged_autosel(path):
                return _readonly(path, f"cannot be opened for writing ({exc})", ro=not is_corrupt(exc))
            moved = _move_aside(path, inode)  # only the file we found corrupt, not one a racer just created
            where = f"moved aside to {moved}" if moved else "another process moved it aside"
            warn_once(path, "corrupt", f"tuning DB {path} is corrupt ({exc}); {where} (kept, not deleted) and "
                      "started a new one. Decisions it held will be tuned again when needed.")
            problem = f"corrupt; {where}"
    raise AssertionError("unreachable")


def _readonly(path: Path, reason: str, *, ro: bool = True) -> list[_Open]:
    """The user DB cannot be written: keep this process's decisions in memory, still read the file if possible."""
    warn_once(path, "readonly", f"tuning DB {path}: {reason}; decisions made by this process are kept in memory "
              "and lost at exit. Set AUTOSEL_DB to a writable file path.")
    layers = [_memory(f"{reason}; decisions kept in memory")]
    try:
        if ro and path.is_file():
            conn = connect(ro_uri(path, immutable=False), uri=True)
            version, _, tables = inspect(conn)
            if "decisions" in tables and identify(conn) == "autosel":
                layers.append(_Open(str(path), "user", conn, writable=False, schema_version=version, problem=reason))
    except (OSError, sqlite3.Error, Corrupt) as exc:
        logger.info("cannot read %s read-only either: %s", path, exc)
    return layers


def _peek_user(path: Path) -> list[_Open]:
    """The user layer for a command that only reads: nothing is created, migrated, stamped or moved aside.
    Its Layer says whether selection could write the file."""
    def unread(problem: str, could_write: bool = False) -> list[_Open]:
        conn = connect(":memory:")
        migrate(conn)  # an empty in-memory stand-in, so the layer lists with no rows
        return [_Open(str(path), "user", conn, writable=False, schema_version=None, problem=problem,
                      could_write=could_write)]

    try:
        if not path.exists():
            folder = next((p for p in path.parents if p.exists()), None)
            return unread("does not exist yet (the first tune creates it)",
                          folder is not None and os.access(folder, os.W_OK))
        # A read-only connection to a WAL-mode file makes its -wal and -shm and cannot remove them when it closes,
        # so each read-only command left two files beside the DB. One that could write removes them as the last
        # to close. It is opened so only where this command would make them (no -wal before it: no other
        # connection, nothing to recover) and never writes: the layer is not writable.
        alone = not Path(f"{path}-wal").exists()
        version, written_by, kind = _inspect_file(path, recover=False)
        could_write = (version <= db_tools.SCHEMA_VERSION and os.access(path, os.W_OK)
                       and os.access(path.parent, os.W_OK))
        conn = connect(path.resolve().as_uri() + "?mode=rw" if could_write and alone
                       else ro_uri(path, immutable=False), uri=True)
    except (OSError, sqlite3.Error, Corrupt, _Interrupted) as exc:
        if isinstance(exc, _Interrupted) or _needs_recovery(exc):
            problem = "a process was killed while writing it; not read"
            remedy = "The next `autosel tune` or selection that opens it recovers it (SQLite's crash recovery)."
        elif is_corrupt(exc) and not isinstance(exc, NotSQLite) and _damaged_autosel(path):
            problem = f"unreadable ({exc})"
            remedy = "Selection will move it aside (kept, not deleted) and start a new one."
        else:
            problem = f"{exc}; not read" if isinstance(exc, NotSQLite) else f"unreadable ({exc}); not read"
            remedy = "Left as it is; point AUTOSEL_DB (or --db) at a tuning DB."
        warn_once(path, "peek", f"tuning DB {path}: {problem}. {remedy}")
        return unread(problem)
    if kind == "foreign":
        conn.close()
        return unread("an SQLite file but not an autosel tuning DB; not read")
    problem = _newer_problem(version, written_by) if version > db_tools.SCHEMA_VERSION else None
    return [_Open(str(path), "user", conn, writable=False, schema_version=version or None, problem=problem,
                  could_write=could_write)]


def _newer_problem(version: int, written_by: str) -> str:
    return f"schema {version} written by autosel {written_by} is newer than this autosel's {db_tools.SCHEMA_VERSION}"


def _newer(path: Path, version: int, written_by: str) -> list[_Open]:
    problem = _newer_problem(version, written_by)
    warn_once(path, "newer", f"tuning DB {path} has {problem}; reading it without changing it, and keeping new "
              f"decisions in memory. Upgrade autosel to {written_by} or later, or set AUTOSEL_DB to another file.")
    conn = connect(ro_uri(path, immutable=False), uri=True)
    return [_memory(f"user DB is read-only ({problem}); decisions kept in memory"),
            _Open(str(path), "user", conn, writable=False, schema_version=version, problem=problem)]


def _open_shipped(path: Path) -> _Open | None:
    try:
        with open(path, "rb") as f:  # a copy of a live WAL-mode DB keeps rows in a -wal that immutable never reads
            wal = f.read(20)[18:20] == b"\x02\x02"
        conn = connect(ro_uri(path, immutable=True), uri=True)  # immutable: no -wal/-shm, no locks, no writes
        version, written_by, tables = inspect(conn)
        if "decisions" not in tables:
            raise Corrupt("WAL-mode file: its tables are in a -wal that is not read" if wal
                          else "it has no decisions table; it is not an autosel tuning DB")
        if identify(conn) == "foreign":
            raise Corrupt("it is an SQLite file but not an autosel tuning DB")
    except (OSError, sqlite3.Error, Corrupt) as exc:
        warn_once(path, "shipped", f"shipped tuning DB {path} is unreadable ({exc}); skipped. Replace it with a "
                  "file from `autosel export --format sqlite`, or remove it from AUTOSEL_DB_PATH.")
        return None
    problem = None
    if version > db_tools.SCHEMA_VERSION:
        problem = _newer_problem(version, written_by)
        warn_once(path, "newer", f"shipped tuning DB {path} has {problem}; reading the rows that parse. "
                  f"Upgrade autosel to {written_by} or later.")
    if wal or not conn.execute("SELECT count(*) FROM decisions").fetchone()[0]:
        problem = "WAL-mode file: rows still in a -wal next to it are not read" if wal else "no decisions in it"
        warn_once(path, "empty", f"shipped tuning DB {path}: {problem}. Ship a file made by "
                  "`autosel export --format sqlite` (a single file in DELETE journal mode), not a copy of a user DB.")
    return _Open(str(path), "shipped", conn, writable=False, schema_version=version, problem=problem)


def _expanded(path: Path | str, what: str) -> Path:
    try:
        return Path(path).expanduser()
    except (TypeError, RuntimeError) as exc:  # "~nosuchuser/x.db": no such home folder
        raise ValueError(f"{what} {str(path)!r} cannot be expanded ({exc}); write it without ~ or with "
                         "an existing user's ~name") from None


def package_folder() -> Path | None:
    """The folder of the DBs shipped in the package (autosel.tuning_db), the last read-only layer; None if absent."""
    try:
        return Path(str(importlib.resources.files("autosel.tuning_db")))
    except (ModuleNotFoundError, TypeError):
        source_tree = Path(__file__).resolve().parent.parent / "tuning_db"  # running from a checkout
        return source_tree if source_tree.is_dir() else None


def _shipped_paths(shipped: Sequence[Path], include_package: bool) -> list[Path]:
    entries = list(shipped)
    folder = package_folder() if include_package else None
    entries += [folder] if folder is not None else []
    files: list[Path] = []
    for entry in entries:
        try:
            kind = "dir" if entry.is_dir() else "file" if entry.is_file() else None
        except OSError:  # a name too long for the file system, say
            kind = None
        if kind == "dir":
            files += sorted(entry.glob("*.db"))
        elif kind == "file":
            files.append(entry)
        else:
            warn_once(entry, "missing", f"shipped tuning DB path {entry} does not exist; ignored. "
                      "Fix AUTOSEL_DB_PATH (files or folders of *.db separated by ':').")
    return files


LEASE_CHECKS_S = 60.0  # a tune's checks (compilation included) come before its budget starts


def lease_seconds(budget_s: float) -> float:
    """How long a tune with this budget may hold its lease before others take it over: its checks, then its
    timing, which the budget stops after the round in progress (so at most about twice the budget)."""
    return LEASE_CHECKS_S + 2.0 * budget_s


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child that nobody reaped yet is a zombie: dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


_SAME_TUNE = "platform_key = ? AND op = ? AND mode = ? AND versions_hash = ?"


def _same_tune_params(decision: Decision) -> tuple:
    key = decision.key
    return (key.platform_key, key.op, key.mode, key.versions_hash, OP_LEVEL_BUCKET)


class TuningDB:
    """The user layer first, then shipped layers; reads go down the layers, writes go to the user layer only."""

    def __init__(self, opener: Callable[[], list[_Open]]):
        self._opener, self._pid, self._layers = opener, os.getpid(), opener()
        self._lock, self._inherited = threading.RLock(), []

    @classmethod
    def open(cls, user: Path | None, shipped: Sequence[Path] = (), *, include_package: bool = True,
             read_only: bool = False) -> "TuningDB":
        """read_only: for commands that only read: the user file is neither created, migrated nor moved aside
        (a missing one is an empty layer), and decisions recorded go to memory."""
        user = _expanded(user, "the user tuning DB path") if user is not None else None
        shipped = [_expanded(p, "a shipped tuning DB path") for p in shipped]

        def opener() -> list[_Open]:
            if user is None:
                layers = [_memory()]
            else:
                layers = _peek_user(user) if read_only else _open_user(user)
            seen = {os.path.realpath(layer.path) for layer in layers}
            for path in _shipped_paths(shipped, include_package):
                if os.path.realpath(path) not in seen:
                    seen.add(os.path.realpath(path))
                    opened = _open_shipped(path)
                    layers += [opened] if opened else []
            return layers

        return cls(opener)

    def _here(self) -> list[_Open]:
        # SQLite connections must not cross fork(): a child (DataLoader, forked workers) opens its own.
        # The inherited ones are kept unclosed: closing them in the child could disturb the parent's locks.
        if os.getpid() != self._pid:
            self._inherited.append(self._layers)
            self._pid, self._layers = os.getpid(), self._opener()
        return self._layers

    @classmethod
    def from_settings(cls, settings: "Settings") -> "TuningDB":
        return cls.open(settings.db, settings.db_path)

    def __enter__(self) -> "TuningDB":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def layers(self) -> list[Layer]:
        with self._lock:
            return [layer.layer() for layer in self._here()]

    def lookup(self, key: DecisionKey, usable: Callable[[str], bool] = lambda backend: True
               ) -> tuple[Decision, Layer] | None:
        """The first layer's decision for exactly this key whose winner is usable here; None is a miss."""
        where = "WHERE " + " AND ".join(f"{c} = ?" for c in KEY_COLUMNS)
        params = (key.platform_key, key.op, key.mode, key.bucket, key.versions_hash)
        with self._lock:
            for layer in self._here():
                for row in layer.select(where, params):
                    decision = parse_row(layer.path, row)
                    if decision is None:
                        continue
                    if usable(decision.winner):
                        return decision, layer.layer()
                    logger.debug("%s: winner %r of %s is not usable here; trying the next layer",
                                 layer.path, decision.winner, key.op)
        return None

    def lookup_near(self, key: DecisionKey, usable: Callable[[str], bool] = lambda backend: True, *,
                    match: str) -> tuple[Decision, Layer] | None:
        """When lookup(key) missed and AUTOSEL_MATCH accepts near rows: the closest stored decision for the same
        op, mode and bucket under another version vector ("device") or also on another model of the same arch
        ("arch"). Closest: the same device before the same arch, then the earlier layer, then the newest row."""
        found = []
        with self._lock:
            for index, layer in enumerate(self._here()):
                for row in layer.select("WHERE op = ? AND mode = ? AND bucket = ?", (key.op, key.mode, key.bucket)):
                    rank = near_rank(row[0], key.platform_key, match)
                    if rank is None or (row[0], row[4]) == (key.platform_key, key.versions_hash):
                        continue  # not accepted, or the exact key (whose winner lookup found unusable)
                    decision = parse_row(layer.path, row)
                    if decision is not None and usable(decision.winner):
                        found.append((rank, index, decision, layer))
            if not found:
                return None
            found.sort(key=lambda item: item[2].created_at, reverse=True)
            rank, index, decision, layer = min(found, key=lambda item: item[:2])  # min keeps the first: the newest
            return decision, layer.layer()

    def _writable(self) -> _Open:
        for layer in self._here():
            if layer.writable and not layer.broken:
                return layer
        self._layers.insert(0, _memory("no writable layer left; decisions kept in memory"))
        return self._layers[0]

    def record(self, decision: Decision, buckets: Sequence[Decision] | None = None) -> Layer:
        """Upsert into the user layer (replacing the row with the same key); returns the layer written.
        buckets: the per-bucket decisions of the same tune, written in the same transaction in place of every
        bucket row an earlier tune of the same key left (a tune's table is never mixed with another's)."""
        rows = [decision_row(decision)] + [decision_row(b) for b in buckets or ()]
        with self._lock:
            while True:
                layer = self._writable()
                try:
                    with immediate(layer.conn):
                        if buckets is not None:
                            layer.conn.execute(f"DELETE FROM decisions WHERE {_SAME_TUNE} AND bucket != ?",
                                               _same_tune_params(decision))
                        layer.db["decisions"].upsert_all(rows, pk=KEY_COLUMNS)
                    return layer.layer()
                except sqlite3.Error as exc:
                    if layer.kind == "memory":
                        raise DatabaseError(f"writing a decision for {decision.op} in memory failed: {exc}") from exc
                    self._write_failed(layer, exc)

    def buckets(self, decision: Decision, layer: Layer, usable: Callable[[str], bool] = lambda backend: True
                ) -> list[Decision]:
        """The per-bucket rows stored beside `decision` (same platform, op, mode and versions) in `layer`,
        whose winners are usable here."""
        with self._lock:
            for here in self._here():
                if here.path == layer.path:
                    rows = here.select(f"WHERE {_SAME_TUNE} AND bucket != ?", _same_tune_params(decision))
                    return [d for d in (parse_row(here.path, r) for r in rows) if d is not None and usable(d.winner)]
        return []

    def decisions(self, op_glob: str | None = None) -> list[tuple[Decision, Layer]]:
        """Every valid row of every layer, user layer first (for `autosel show`)."""
        out = []
        with self._lock:
            for layer in self._here():
                rows = layer.select("WHERE op GLOB ?", (op_glob,)) if op_glob else layer.select()
                snapshot = layer.layer()
                out += [(d, snapshot) for d in (parse_row(layer.path, r) for r in rows) if d is not None]
        return out

    def prune(self, is_current: Callable[[Decision], bool]) -> int:
        """Delete writable-layer rows that are invalid or for which is_current is False; returns how many."""
        removed = 0
        with self._lock:
            for layer in (lay for lay in self._here() if lay.writable and not lay.broken):
                stale = [r[: len(KEY_COLUMNS)] for r in layer.select()
                         if (d := parse_row(layer.path, r)) is None or not is_current(d)]
                with immediate(layer.conn):
                    for key in stale:
                        layer.conn.execute(
                            "DELETE FROM decisions WHERE " + " AND ".join(f"{c} = ?" for c in KEY_COLUMNS), key)
                removed += len(stale)
        return removed

    @contextmanager
    def lease(self, platform_key: str, op: str, mode: str, *, budget_s: float | None = None,
              ttl_s: float | None = None, wait_s: float | None = None, poll_s: float = 0.2) -> Iterator[bool]:
        """True: this process holds the tuning lease (tune, record, release on exit). False: another holder
        finished while we waited; look up again.

        budget_s: the tune's time budget; the lease expires, and a waiter stops waiting and takes it over, after
        lease_seconds(budget_s) unless ttl_s / wait_s say otherwise. A waiter logs once whom it waits for.
        When the DB cannot be written (read-only file, a write lock held past the busy timeout), this process
        tunes without a lease and keeps its decisions in memory, with one warning, as record() does.
        """
        limit_s = lease_seconds(DEFAULT_BUDGET_S if budget_s is None else budget_s)
        ttl_s, wait_s = limit_s if ttl_s is None else ttl_s, limit_s if wait_s is None else wait_s
        layer = next((lay for lay in self._here() if lay.kind == "user" and lay.writable and not lay.broken), None)
        if layer is None:  # nobody to coordinate with through a file
            yield True
            return
        token = f"{uuid.uuid4().hex}@{time.time():.0f}"  # "@taken_at": waiters can say since when it is held
        try:
            took = self._acquire(layer, (platform_key, op, mode), token, ttl_s, wait_s, poll_s)
        except sqlite3.Error as exc:
            self._write_failed(layer, exc)
            took, layer = True, None
        try:
            yield took
        finally:
            if took and layer is not None:
                try:
                    with self._lock, immediate(layer.conn):
                        layer.conn.execute("DELETE FROM leases WHERE token = ?", (token,))
                except sqlite3.Error as exc:
                    logger.warning("could not release the tuning lease on %s (%s): %s; it expires after %.0f s",
                                   op, layer.path, exc, ttl_s)

    def _write_failed(self, layer: _Open, exc: sqlite3.Error) -> None:
        layer.writable, layer.problem = False, f"write failed: {exc}; decisions kept in memory"
        warn_once(layer.path, "write", f"writing to tuning DB {layer.path} failed ({exc}); new decisions are "
                  "kept in memory for this process. Check free space and permissions, or whether another "
                  "process holds a write transaction open.")

    def _acquire(self, layer: _Open, key: tuple[str, str, str], token: str, ttl_s: float, wait_s: float,
                 poll_s: float) -> bool:
        host, start, waited, holder = socket.gethostname(), time.monotonic(), False, None
        while True:
            with self._lock, immediate(layer.conn):
                row = layer.conn.execute("SELECT host, pid, expires_at, token FROM leases WHERE platform_key = ? "
                                         "AND op = ? AND mode = ?", key).fetchone()
                if row is None and waited:
                    return False
                now = time.time()
                if row is not None and row[3] != holder:  # a new holder (one that took a hung one's over, say)
                    start, holder = time.monotonic(), row[3]  # gets the whole wait again
                stale = row is not None and (row[2] < now or (row[0] == host and not _pid_alive(row[1])))
                overdue = row is not None and time.monotonic() - start > wait_s
                if row is None or stale or overdue:
                    layer.db["leases"].upsert(
                        {"platform_key": key[0], "op": key[1], "mode": key[2], "host": host, "pid": os.getpid(),
                         "token": token, "expires_at": now + ttl_s}, pk=("platform_key", "op", "mode"))
            if row is not None and stale:
                logger.info("took over the tuning lease on %s from pid %s on %s (dead or expired)", key[1], *row[1::-1])
            elif row is not None and overdue:
                warn_once(layer.path, "lease-overdue", f"waited {wait_s:.0f} s for the tuning lease on {key[1]} "
                          f"({key[2]}) held by pid {row[1]} on {row[0]}; taking it over. If that process is stuck, "
                          "stop it; if tuning takes that long, give it a larger budget.")
            if row is None or stale or overdue:
                return True
            if not waited:
                self._say_waiting(key, row, min(wait_s, max(0.0, row[2] - now)))
            waited = True
            time.sleep(poll_s)

    @staticmethod
    def _say_waiting(key: tuple[str, str, str], row: tuple, at_most_s: float) -> None:
        host, pid, _, token = row
        _, at, taken = str(token).rpartition("@")
        since = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(taken))) if at and taken.isdigit()
                 else "an unknown time (an older autosel)")
        logger.warning("waiting for the tuning lease on %s (%s mode), held by pid %s on %s since %s: that process is "
                       "tuning it; this one uses its decision when it is done, or takes the lease over in at most "
                       "%.0f s. To stop waiting: end pid %s on %s if it is stuck (a dead holder's lease is taken "
                       "over at once), or choose a backend yourself (backend=..., AUTOSEL_BACKEND).",
                       key[1], key[2], pid, host, since, at_most_s, pid, host)

    def close(self) -> None:
        with self._lock:
            for layer in self._layers if os.getpid() == self._pid else []:
                layer.conn.close()
            self._layers, self._opener = [], list
