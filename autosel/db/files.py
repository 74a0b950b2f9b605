"""A tuning DB's files: the user file opened for writing (created, migrated, recovered after a killed writer,
moved aside when damaged, else kept in memory, left ready to ship when closed) or only peeked at, the shipped
files read as immutable, and the Layer each becomes."""

from __future__ import annotations

import logging
import os
import sqlite3
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from autosel import state
from autosel.db import tools as db_tools
from autosel.db.tools import (
    OWN_TABLES, ROW_COLUMNS, SQLITE_MAGIC, Corrupt, NotSQLite, connect, header_application_id, identify, inspect,
    is_corrupt, migrate, reading_uri, ro_uri, wal_mode,
)
from autosel.files import NotRegularFile, check_regular, open_regular, special_kind

logger = logging.getLogger(__name__)


def warn_once(path: object, condition: str, message: str) -> None:
    """One RuntimeWarning per (path, condition) per process (until clear_cache()): degraded but working, remedy in
    the sentence. Python shows it at the first line outside autosel (the user's get_kernel call), not at a line of
    autosel's own."""
    said = state.process.said.db_conditions
    if (str(path), condition) not in said:
        said.add((str(path), condition))
        warnings.warn(message, RuntimeWarning, stacklevel=_outside_autosel())


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # autosel's own folder


def _outside_autosel() -> int:
    """warn_once's stacklevel for the first frame on the stack whose code is not in the autosel package."""
    level, frame = 2, sys._getframe(2)  # this function's, then warn_once's caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level


@dataclass(frozen=True)
class Layer:
    """The state of one layer, for `autosel doctor` and `show`."""

    path: str  # ":memory:" for the in-memory fallback
    kind: str  # "user" | "shipped" | "memory"
    writable: bool
    schema_version: int | None
    rows: int
    problem: str | None
    fix: str | None = None  # for a user file that could not be read: "recover" (crash recovery) or "move_aside"


class OpenFile:
    """One open layer: its connection and what is known about it."""

    def __init__(self, path: str, kind: str, conn: sqlite3.Connection, *, writable: bool,
                 schema_version: int | None, problem: str | None = None, could_write: bool | None = None,
                 fix: str | None = None):
        """could_write: opened read-only for a command that only reads, whether selection could write the file.
        fix: what would make an unread file readable (Layer.fix)."""
        self.path, self.kind, self.conn, self.writable = path, kind, conn, writable
        self.schema_version, self.problem, self.broken = schema_version, problem, False
        self.could_write, self.fix = could_write, fix
        self.warn_on_write: tuple[Path, str] | None = None  # (path, warning) for the first decision written here
        self._db = None
        # A connection is in a reference cycle with its own statement cache, so one dropped unclosed lingers until
        # a garbage collection, or past exit, and leaves a WAL file's -wal and -shm behind: closed with its layer.
        # At exit the TuningDBs still open close theirs, leaving each file ready to ship (autosel.db).
        self._finalizer = weakref.finalize(self, _close_connection, conn, os.getpid())
        self._finalizer.atexit = False

    def writer(self):
        """sqlite-utils' view of a writable layer, for a write about to start (outside a transaction: sqlite-utils
        and the journal switch each set a PRAGMA). Made at the first write (db_tools.writer says why), and a user
        file goes to WAL mode there, not when it is opened: a process that only reads its decisions leaves the file
        as it found it, in rollback mode, with no switch each way (seven fsyncs: about 1.5 ms on a quiet disk, 20-28
        ms of a first get_kernel on a busy one)."""
        if self._db is None and self.writable:
            if self.kind == "user":
                _start_writing(self.conn)
            self._db = db_tools.writer(self.conn)
        return self._db

    def layer(self) -> Layer:
        try:
            rows = self.conn.execute("SELECT count(*) FROM decisions").fetchone()[0]
        except sqlite3.Error:
            rows = 0
        writable = self.could_write if self.could_write is not None else self.writable and not self.broken
        return Layer(self.path, self.kind, writable, self.schema_version, rows, self.problem, self.fix)

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

    def close(self) -> None:
        if self.kind == "user" and self.writable and not self.broken:
            _leave_ready_to_ship(self.path, self.conn)
        self._finalizer()


def _close_connection(conn: sqlite3.Connection, pid: int) -> None:
    if os.getpid() == pid:  # a forked child leaves the connections it inherited alone (TuningDB._here)
        conn.close()


def _leave_ready_to_ship(path: str, conn: sqlite3.Connection) -> None:
    """Back to rollback journal mode (checkpointed, no -wal or -shm: one file any SQLite reads, from a read-only
    folder too) if the file is in WAL mode and this is its last connection. WAL mode was only for the writers
    open together, and the next writer switches to it again. In WAL mode every other open connection holds a
    shared lock that makes the switch fail at once (busy timeout 0): then it stays WAL, and its last connection
    removes the -wal and -shm when it closes. A connection that only read a file in rollback mode has nothing
    to switch back (it reports the mode its last read found)."""
    if conn.in_transaction:
        return
    try:
        if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            return
        conn.execute("PRAGMA busy_timeout = 0")  # never wait at close: a lock held means another connection
        conn.execute("PRAGMA journal_mode = DELETE")
    except sqlite3.Error as exc:
        logger.debug("%s: left in WAL mode for the connections still open (%s)", path, exc)


def memory_file(problem: str | None = None) -> OpenFile:
    conn = connect(":memory:")
    migrate(conn)
    return OpenFile(":memory:", "memory", conn, writable=True, schema_version=db_tools.SCHEMA_VERSION, problem=problem)


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
        with open_regular(path, "rb") as f:  # a FIFO would block here for good
            head = f.read(len(SQLITE_MAGIC))
        if attempt and not head:
            return 0, "unknown", "empty"  # rolled back to nothing: a new file
        if head != SQLITE_MAGIC:
            if not Path(f"{path}-journal").exists():
                raise NotSQLite("it is not an SQLite file (no SQLite header)")
            if not recover or attempt:
                raise _Interrupted("a process was killed while writing it")
        else:
            conn = connect(reading_uri(path)[0], uri=True)  # no write access needed, nothing left beside it
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
        conn = connect(reading_uri(path)[0], uri=True)
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            conn.close()
    except sqlite3.Error:
        return False
    return tables == OWN_TABLES


def _start_writing(conn: sqlite3.Connection) -> None:
    """A user file's connection before its first write: WAL journal, for the writers open together, and
    synchronous NORMAL (WAL + NORMAL: a killed process loses nothing committed). PRAGMA journal_mode = WAL is
    retried while busy: the switch does not wait through the busy timeout, so a process creating the DB next to
    another one (or next to one killed mid-creation) got "database is locked" and fell back to memory for good.
    A no-op on a file in WAL mode already."""
    conn.execute("PRAGMA synchronous = NORMAL")
    deadline = time.monotonic() + db_tools.BUSY_TIMEOUT_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def open_user(path: Path) -> list[OpenFile]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _readonly(path, f"cannot create folder {path.parent} ({db_tools.why_unwritable(path, exc)})")
    problem = None
    for attempt in range(2):
        inode, conn = _inode(path), None
        try:
            special = special_kind(path)
            if special is not None:  # SQLite would wait on a FIFO, open a device and leave a journal beside it
                return _readonly(path, f"it is {special}, not a regular file; left untouched", ro=False)
            if path.is_file() and path.stat().st_size:
                version, written_by, kind = _inspect_file(path)
                if version > db_tools.SCHEMA_VERSION:
                    return _newer(path, version, written_by)
                if kind == "foreign":
                    return _readonly(path, "it is an SQLite file but not an autosel tuning DB; left untouched",
                                     ro=False)
            if path.exists() and not os.access(path, os.W_OK):
                return _readonly(path, "the file is read-only")
            if not os.access(path.parent, os.W_OK):  # SQLite writes a journal beside the file
                return _readonly(path, f"its folder {path.parent} is read-only")
            conn = connect(str(path))
            if identify(conn) == "foreign":  # someone made it something else since we looked
                conn.close()
                return _readonly(path, "it is an SQLite file but not an autosel tuning DB; left untouched",
                                 ro=False)
            if not db_tools.migrated(conn):  # a new file, or an older schema: written now, as every write, in WAL
                _start_writing(conn)
                migrate(conn)
            return [OpenFile(str(path), "user", conn, writable=True, schema_version=db_tools.SCHEMA_VERSION,
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


def _readonly(path: Path, reason: str, *, ro: bool = True) -> list[OpenFile]:
    """The user DB cannot be written: keep this process's decisions in memory, still read the file if possible.
    The warning comes at once where the file cannot be read, else with the first decision kept in memory: a DB
    shipped read-only in an image is read by every process, and most of them never write (OpenFile.warn_on_write)."""
    memory = memory_file(f"{reason}; decisions kept in memory")
    memory.warn_on_write = (path, f"tuning DB {path}: {reason}; decisions made by this process are kept in memory "
                                  "and lost at exit. Set AUTOSEL_DB to a writable file path.")
    layers = [memory]
    try:
        if ro and path.is_file():
            conn = connect(reading_uri(path)[0], uri=True)
            version, _, tables = inspect(conn)
            if "decisions" in tables and identify(conn) == "autosel":
                layers.append(OpenFile(str(path), "user", conn, writable=False, schema_version=version, problem=reason))
    except (OSError, sqlite3.Error, Corrupt) as exc:
        logger.info("cannot read %s read-only either: %s", path, exc)
    if len(layers) == 1:
        warn_once(path, "readonly", memory.warn_on_write[1])
    return layers


def peek_user(path: Path) -> list[OpenFile]:
    """The user layer for a command that only reads: nothing is created, migrated, stamped or moved aside.
    Its Layer says whether selection could write the file."""
    def unread(problem: str, could_write: bool = False, fix: str | None = None) -> list[OpenFile]:
        conn = connect(":memory:")
        migrate(conn)  # an empty in-memory stand-in, so the layer lists with no rows
        return [OpenFile(str(path), "user", conn, writable=False, schema_version=None, problem=problem,
                         could_write=could_write, fix=fix)]

    try:
        if not path.exists():
            folder = db_tools.nearest_existing(path)
            if folder is not None and not folder.is_dir():  # tune would fail to create the folder: say so now
                return unread(f"cannot be created: {folder} is not a folder")
            return unread("does not exist yet (the first tune creates it)",
                          folder is not None and os.access(folder, os.W_OK))
        version, written_by, kind = _inspect_file(path, recover=False)
        could_write = (version <= db_tools.SCHEMA_VERSION and os.access(path, os.W_OK)
                       and os.access(path.parent, os.W_OK))
        uri, unread_wal = reading_uri(path)  # never writes: the layer is not writable
        conn = connect(uri, uri=True)
    except (OSError, sqlite3.Error, Corrupt, _Interrupted) as exc:
        fix = None
        if isinstance(exc, _Interrupted) or _needs_recovery(exc):
            problem, fix = "a process was killed while writing it; not read", "recover"
            remedy = "The next `autosel tune` or selection that opens it recovers it (SQLite's crash recovery)."
        elif isinstance(exc, NotRegularFile):
            problem, remedy = f"it is {exc.kind}, not a regular file; not read", "Point AUTOSEL_DB (or --db) at a file."
        elif is_corrupt(exc) and not isinstance(exc, NotSQLite) and _damaged_autosel(path):
            problem, fix = f"unreadable ({exc})", "move_aside"
            remedy = "Selection will move it aside (kept, not deleted) and start a new one."
        else:
            problem = f"{exc}; not read" if isinstance(exc, NotSQLite) else f"unreadable ({exc}); not read"
            remedy = "Left as it is; point AUTOSEL_DB (or --db) at a tuning DB."
        warn_once(path, "peek", f"tuning DB {path}: {problem}. {remedy}")
        return unread(problem, fix=fix)
    if kind == "foreign":
        conn.close()
        return unread("an SQLite file but not an autosel tuning DB; not read")
    problem = _newer_problem(version, written_by) if version > db_tools.SCHEMA_VERSION else None
    if unread_wal:
        warn_once(path, "peek-wal", f"tuning DB {path}: {unread_wal}. Copy it with its -shm, or run `autosel export "
                  f"--db {path} --out FILE` where its folder is writable and use FILE.")
        problem = "; ".join(p for p in (problem, unread_wal) if p)
    return [OpenFile(str(path), "user", conn, writable=False, schema_version=version or None, problem=problem,
                  could_write=could_write)]


def _newer_problem(version: int, written_by: str) -> str:
    return f"schema {version} written by autosel {written_by} is newer than this autosel's {db_tools.SCHEMA_VERSION}"


def _newer(path: Path, version: int, written_by: str) -> list[OpenFile]:
    problem = _newer_problem(version, written_by)
    warn_once(path, "newer", f"tuning DB {path} has {problem}; reading it without changing it, and keeping new "
              f"decisions in memory. Upgrade autosel to {written_by} or later, or set AUTOSEL_DB to another file.")
    conn = connect(reading_uri(path)[0], uri=True)
    return [memory_file(f"user DB is read-only ({problem}); decisions kept in memory"),
            OpenFile(str(path), "user", conn, writable=False, schema_version=version, problem=problem)]


def open_shipped(path: Path) -> OpenFile | None:
    # A WAL-mode file is fine when its writer closed it (all in the file: a DB `autosel tune` left in WAL mode
    # because another process still had it open). Not so a copy of a live one: its rows are in a -wal that
    # immutable never reads, left behind in the copy or lying beside it.
    try:
        check_regular(path)  # a FIFO named *.db in a shipped folder: SQLite's open would wait on it for good
        wal = wal_mode(path)
        side = Path(f"{path}-wal")
        stray_wal = wal and side.is_file() and side.stat().st_size > 0
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
    empty = not conn.execute("SELECT count(*) FROM decisions").fetchone()[0]
    if stray_wal or empty:
        problem = ("WAL-mode file: rows in the -wal next to it are not read" if stray_wal
                   else "WAL-mode file with no decisions: a copy of a user DB taken while it was open leaves its "
                   "rows behind in a -wal" if wal else "no decisions in it")
        warn_once(path, "empty", f"shipped tuning DB {path}: {problem}. Ship the DB `autosel tune --db` wrote once "
                  "every process writing it has exited, or a file made by `autosel export --format sqlite`.")
    return OpenFile(str(path), "shipped", conn, writable=False, schema_version=version, problem=problem)
