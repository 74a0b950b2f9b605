"""The tuning database: layered SQLite files of decisions with their evidence, safe under many processes."""

from __future__ import annotations

import atexit
import importlib.resources
import logging
import os
import socket
import sqlite3
import threading
import time
import uuid
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence, TypeVar

from autosel.config import DEFAULT_BUDGET_S
from autosel.db.files import Layer, OpenFile, memory_file, open_shipped, open_user, peek_user, warn_once
from autosel.db.tools import (
    KEY_COLUMNS, Conflict, MergeReport, decision_row, export_decisions, immediate, merge, parse_row, read_decisions,
)
from autosel.decisions import OP_LEVEL_BUCKET, Decision, DecisionKey
from autosel.errors import DatabaseError
from autosel.files import special_kind
from autosel.platforms import near_rank

if TYPE_CHECKING:
    from autosel.config import Settings

__all__ = ["Conflict", "Layer", "MergeReport", "TuningDB", "export_decisions", "merge", "read_decisions"]

logger = logging.getLogger(__name__)


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
        source_tree = Path(__file__).resolve().parents[2] / "tuning_db"  # running from a checkout
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
            special = special_kind(entry)  # never opened: SQLite's open waits on a FIFO for good
            what = f"is {special}, not a file or folder of *.db" if special else "does not exist"
            warn_once(entry, "missing", f"shipped tuning DB path {entry} {what}; ignored. "
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


# Every TuningDB not yet closed, to close at exit: open files, not a memo, so neither clear_cache() nor a test's fresh
# autosel.state forgets one (a forked child leaves its parent's alone: TuningDB._here, _close_connection).
_open_dbs: weakref.WeakSet[TuningDB] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    # A tune's DB (autosel.tuning.database()) stays open until the process ends: closed here, the last process
    # writing it leaves a file ready to ship (see OpenFile.close) instead of one in WAL mode.
    for db in list(_open_dbs):
        try:
            db.close()
        except sqlite3.Error as exc:  # at exit, a file gone or locked must not keep the interpreter from ending
            logger.debug("closing a tuning DB at exit failed: %s", exc)


T = TypeVar("T")


def closest(found: Iterable[tuple[int, int, str, T]]) -> T | None:
    """The near row lookup_near takes among (rank, layer index, created_at, row) tuples of rows that fit: the same
    device before the same arch, then the earlier layer, then the newest row; None when none fit. `autosel show`
    and `autosel check` pick with it too, so they name the row selection runs."""
    newest_first = sorted(found, key=lambda item: item[2], reverse=True)
    best = min(newest_first, key=lambda item: item[:2], default=None)  # min keeps the first: the newest
    return None if best is None else best[3]


class TuningDB:
    """The user layer first, then shipped layers; reads go down the layers, writes go to the user layer only."""

    def __init__(self, opener: Callable[[], list[OpenFile]]):
        self._opener, self._pid, self._layers = opener, os.getpid(), opener()
        self._lock, self._inherited = threading.RLock(), []
        self._turns: dict[tuple[str, str, str], threading.Lock] = {}  # the lease without a file (lease())
        _open_dbs.add(self)

    @classmethod
    def open(cls, user: Path | None, shipped: Sequence[Path] = (), *, include_package: bool = True,
             read_only: bool = False) -> "TuningDB":
        """read_only: for commands that only read: the user file is neither created, migrated nor moved aside
        (a missing one is an empty layer), and decisions recorded go to memory."""
        user = _expanded(user, "the user tuning DB path") if user is not None else None
        shipped = [_expanded(p, "a shipped tuning DB path") for p in shipped]

        def opener() -> list[OpenFile]:
            if user is None:
                layers = [memory_file()]
            else:
                layers = peek_user(user) if read_only else open_user(user)
            seen = {os.path.realpath(layer.path) for layer in layers}
            for path in _shipped_paths(shipped, include_package):
                if os.path.realpath(path) not in seen:
                    seen.add(os.path.realpath(path))
                    opened = open_shipped(path)
                    layers += [opened] if opened else []
            return layers

        return cls(opener)

    def _here(self) -> list[OpenFile]:
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

    def lookup(self, key: DecisionKey, usable: Callable[[str], bool] = lambda backend: True,
               fits: Callable[[Decision, Layer], bool] = lambda decision, layer: True
               ) -> tuple[Decision, Layer] | None:
        """The first layer's decision for exactly this key whose winner is usable here and that `fits` in its layer
        (timed every backend eligible here, Decision.untimed; its bucket rows' winners usable); None is a miss."""
        where = "WHERE " + " AND ".join(f"{c} = ?" for c in KEY_COLUMNS)
        params = (key.platform_key, key.op, key.mode, key.bucket, key.versions_hash)
        with self._lock:
            for layer in self._here():
                for row in layer.select(where, params):
                    decision = parse_row(layer.path, row)
                    if decision is None:
                        continue
                    if usable(decision.winner) and fits(decision, layer.layer()):
                        return decision, layer.layer()
                    logger.debug("%s: the decision for %s (winner %r) is not usable here; trying the next layer",
                                 layer.path, key.op, decision.winner)
        return None

    def lookup_near(self, key: DecisionKey, usable: Callable[[str], bool] = lambda backend: True, *,
                    match: str, fits: Callable[[Decision, Layer], bool] = lambda decision, layer: True
                    ) -> tuple[Decision, Layer] | None:
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
                    if decision is not None and usable(decision.winner) and fits(decision, layer.layer()):
                        found.append((rank, index, decision.created_at, (decision, layer.layer())))
            return closest(found)

    def _writable(self) -> OpenFile:
        for layer in self._here():
            if layer.writable and not layer.broken:
                return layer
        self._layers.insert(0, memory_file("no writable layer left; decisions kept in memory"))
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
                    writer = layer.writer()  # before the transaction; the switch to WAL may fail (OpenFile.writer)
                    with immediate(layer.conn):
                        if buckets is not None:
                            layer.conn.execute(f"DELETE FROM decisions WHERE {_SAME_TUNE} AND bucket != ?",
                                               _same_tune_params(decision))
                        writer["decisions"].upsert_all(rows, pk=KEY_COLUMNS)
                    if layer.warn_on_write:  # a read-only user file: said now, when a decision is lost at exit
                        warn_once(layer.warn_on_write[0], "readonly", layer.warn_on_write[1])
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
        """Delete writable-layer rows for which is_current is False; returns how many. A row this autosel cannot
        read is kept: a newer autosel may have written it, and what prune removes is listed first."""
        removed = 0
        with self._lock:
            for layer in (lay for lay in self._here() if lay.writable and not lay.broken):
                stale = [r[: len(KEY_COLUMNS)] for r in layer.select()
                         if (d := parse_row(layer.path, r)) is not None and not is_current(d)]
                layer.writer()  # before the transaction (OpenFile.writer)
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
        finished while we waited; look up again, and take the lease again before timing anything.

        budget_s: the tune's time budget; the lease expires, and a waiter stops waiting and takes it over, after
        lease_seconds(budget_s) unless ttl_s / wait_s say otherwise. A waiter logs once whom it waits for.
        When the DB cannot be written (read-only file, a write lock held past the busy timeout), this process
        tunes without a file lease and keeps its decisions in memory, with one warning, as record() does; its
        threads still take turns, so that one tunes and the others find its decision (else each tuned, at once,
        and one process ran several decisions).
        """
        limit_s = lease_seconds(DEFAULT_BUDGET_S if budget_s is None else budget_s)
        ttl_s, wait_s = limit_s if ttl_s is None else ttl_s, limit_s if wait_s is None else wait_s
        layer = next((lay for lay in self._here() if lay.kind == "user" and lay.writable and not lay.broken), None)
        token = f"{uuid.uuid4().hex}@{time.time():.0f}"  # "@taken_at": waiters can say since when it is held
        try:
            took = layer is not None and self._acquire(layer, (platform_key, op, mode), token, ttl_s, wait_s, poll_s)
        except sqlite3.Error as exc:
            self._write_failed(layer, exc)
            layer = None
        if layer is None:  # nobody to coordinate with through a file: this process's threads take turns
            with self._turn((platform_key, op, mode), wait_s):
                yield True
            return
        try:
            yield took
        finally:
            if took:
                try:
                    with self._lock, immediate(layer.conn):
                        layer.conn.execute("DELETE FROM leases WHERE token = ?", (token,))
                except sqlite3.Error as exc:
                    logger.warning("could not release the tuning lease on %s (%s): %s; it expires after %.0f s",
                                   op, layer.path, exc, ttl_s)

    @contextmanager
    def _turn(self, key: tuple[str, str, str], wait_s: float) -> Iterator[None]:
        """This process's threads one at a time for `key`, for at most wait_s each, as the file lease would."""
        with self._lock:
            turn = self._turns.setdefault(key, threading.Lock())
        took = turn.acquire(timeout=min(wait_s, threading.TIMEOUT_MAX))
        if not took:
            warn_once("memory", f"turn-overdue {key}", f"waited {wait_s:.0f} s for another thread's tune of {key[1]} "
                      f"({key[2]}); tuning it here too. If tuning takes that long, give it a larger budget.")
        try:
            yield
        finally:
            if took:
                turn.release()

    def _write_failed(self, layer: OpenFile, exc: sqlite3.Error) -> None:
        layer.writable, layer.problem = False, f"write failed: {exc}; decisions kept in memory"
        warn_once(layer.path, "write", f"writing to tuning DB {layer.path} failed ({exc}); new decisions are "
                  "kept in memory for this process. Check free space and permissions, or whether another "
                  "process holds a write transaction open.")

    def _acquire(self, layer: OpenFile, key: tuple[str, str, str], token: str, ttl_s: float, wait_s: float,
                 poll_s: float) -> bool:
        host, start, waited, holder = socket.gethostname(), time.monotonic(), False, None
        writer = layer.writer()  # before the transaction (OpenFile.writer)
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
                    writer["leases"].upsert(
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
        if pid == os.getpid() and host == socket.gethostname():  # ending "that process" would end this one
            logger.info("waiting for the tuning lease on %s (%s mode), held by another thread of this process "
                        "since %s: it is tuning it; this thread uses its decision when it is done (at most %.0f s)",
                        key[1], key[2], since, at_most_s)
            return
        logger.warning("waiting for the tuning lease on %s (%s mode), held by pid %s on %s since %s: that process is "
                       "tuning it; this one uses its decision when it is done, or takes the lease over in at most "
                       "%.0f s. To stop waiting: end pid %s on %s if it is stuck (a dead holder's lease is taken "
                       "over at once), or choose a backend yourself (backend=..., AUTOSEL_BACKEND).",
                       key[1], key[2], pid, host, since, at_most_s, pid, host)

    def close(self) -> None:
        """Close every layer; the user DB is left ready to ship if no other connection has it open."""
        with self._lock:
            for layer in self._layers if os.getpid() == self._pid else []:
                layer.close()
            self._layers, self._opener = [], list
        _open_dbs.discard(self)
