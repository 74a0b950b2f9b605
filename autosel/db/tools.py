"""The tuning DB file format (schema, migrations, rows as data) and file-to-file work: export, import, merge."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from contextlib import contextmanager, suppress
from dataclasses import MISSING, astuple, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from autosel import state
from autosel.decisions import OP_LEVEL_BUCKET, Decision, DecisionKey
from autosel.errors import DatabaseError
from autosel.files import open_regular, special_kind
from autosel.version import __version__

if TYPE_CHECKING:
    from sqlite_utils import Database

logger = logging.getLogger(__name__)


def writer(conn: sqlite3.Connection) -> "Database":
    """sqlite-utils over a connection, for writes. Imported here, not with the module: reading a decision at start-up
    needs only sqlite3, and sqlite-utils (with click, dateutil and pluggy) cost a first get_kernel about 55 ms."""
    from sqlite_utils import Database

    return Database(conn, execute_plugins=False)

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 60.0
KEY_COLUMNS = ("platform_key", "op", "mode", "bucket", "versions_hash")
ROW_COLUMNS = KEY_COLUMNS + ("evidence",)
SQLITE_MAGIC = b"SQLite format 3\x00"
OWN_TABLES = {"decisions", "leases", "meta"}
# PRAGMA application_id of every file autosel writes ("auto"): the mark that a file is autosel's to change.
APPLICATION_ID = 0x6175746F
# The exact schema 1 tables: how a file written before the mark existed is recognised (and then stamped).
SCHEMA_1_COLUMNS = {
    "decisions": {*KEY_COLUMNS, "winner", "created_at", "autosel_version", "evidence"},
    "leases": {"platform_key", "op", "mode", "host", "pid", "token", "expires_at"},
    "meta": {"key", "value"},
}


def autosel_version() -> str:
    return __version__


def _migrate_to_1(db: Database) -> None:
    db["decisions"].create(
        {"platform_key": str, "op": str, "mode": str, "bucket": str, "versions_hash": str, "winner": str,
         "created_at": str, "autosel_version": str, "evidence": str},
        pk=KEY_COLUMNS, not_null={*KEY_COLUMNS, "winner", "evidence"}, if_not_exists=True,
    )
    db["leases"].create(
        {"platform_key": str, "op": str, "mode": str, "host": str, "pid": int, "token": str, "expires_at": float},
        pk=("platform_key", "op", "mode"), if_not_exists=True,
    )
    db["meta"].create({"key": str, "value": str}, pk="key", if_not_exists=True)


# Version n's step turns a schema n-1 file into schema n, inside one write transaction.
MIGRATIONS: dict[int, Callable[[Database], None]] = {1: _migrate_to_1}


class Corrupt(Exception):
    """quick_check failed, or the file is not SQLite at all."""


class NotSQLite(Corrupt):
    """The file does not start with the SQLite header: someone else's file, never autosel's to move."""


def is_corrupt(exc: BaseException) -> bool:
    return isinstance(exc, Corrupt) or getattr(exc, "sqlite_errorname", "") in ("SQLITE_CORRUPT", "SQLITE_NOTADB")


def header_application_id(path: Path) -> int | None:
    """The application id in a file's SQLite header (bytes 68-71), readable even when the rest is damaged."""
    try:
        with open_regular(path, "rb") as f:
            head = f.read(72)
    except OSError:
        return None
    return int.from_bytes(head[68:72], "big") if len(head) == 72 and head.startswith(SQLITE_MAGIC) else None


def identify(conn: sqlite3.Connection) -> str:
    """"autosel" (marked, or the exact schema 1 of a file written before the mark), "empty" (no tables yet:
    a new file) or "foreign" (anything else: never written to)."""
    if conn.in_transaction:
        return _identify(conn)
    conn.execute("BEGIN")  # one snapshot: a file another process is creating must not read half made
    try:
        return _identify(conn)
    finally:
        conn.execute("ROLLBACK")


def _identify(conn: sqlite3.Connection) -> str:
    application_id = conn.execute("PRAGMA application_id").fetchone()[0]
    if application_id:
        return "autosel" if application_id == APPLICATION_ID else "foreign"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
              if not r[0].startswith("sqlite_")}  # SQLite's own (sqlite_stat1 after ANALYZE, ...)
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if not tables and version == 0:
        return "empty"
    if version != 1 or tables != set(SCHEMA_1_COLUMNS):
        return "foreign"
    for table, columns in SCHEMA_1_COLUMNS.items():
        if {r[1] for r in conn.execute(f"PRAGMA table_info({table})")} != columns:
            return "foreign"
    written = conn.execute("SELECT count(*) FROM meta WHERE key = 'schema_written_by'").fetchone()[0]
    return "autosel" if written else "foreign"


def connect(target: str, *, uri: bool = False) -> sqlite3.Connection:
    # isolation_level=None: transactions are ours (BEGIN IMMEDIATE), sqlite-utils nests savepoints in them.
    return sqlite3.connect(target, uri=uri, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)


def ro_uri(path: Path, *, immutable: bool) -> str:
    return path.resolve().as_uri() + ("?mode=ro&immutable=1" if immutable else "?mode=ro")


def wal_mode(path: Path) -> bool:
    """Whether a file's SQLite header says WAL mode (bytes 18 and 19 are 2)."""
    try:
        with open_regular(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return False
    return head.startswith(SQLITE_MAGIC) and head[18:20] == b"\x02\x02"


def reading_uri(path: Path) -> tuple[str, str | None]:
    """How to open a DB file only to read it, needing no write access and leaving no file beside it:
    (URI, what that connection cannot read, or None). A connection opened with it must never write.

    A WAL-mode file (a user DB) is read through a wal-index, <name>-shm, that a read-only connection must create
    when it is absent: in a read-only folder (an image, a read-only mount) it cannot ("unable to open database
    file"), and where it can, it leaves the -shm and -wal behind. So:
    - rollback journal mode (export, build_tuning_db, a user DB its last writer closed), or a -wal beside it
      (a writer has it open, or was killed): mode=ro, with SQLite's locks, as any reader;
    - WAL mode, no -wal, file and folder writable: mode=rw, so that the connection, the last to close, removes
      the -wal and -shm it made;
    - WAL mode, no -wal, file or folder read-only: immutable=1 (no locks, no -shm). Safe only while nobody writes
      the file, which a read-only file or folder says: a writer would need a -wal beside it that it cannot
      create there either.
    """
    base = path.resolve().as_uri()
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    folder_writable = os.access(path.parent, os.W_OK)
    if not wal_mode(path):
        return base + "?mode=ro", None
    if wal.exists():
        if shm.exists() or folder_writable:
            return base + "?mode=ro", None
        # Without a -shm SQLite cannot read a -wal in a read-only folder: read the main file, and say so.
        unread = None
        if wal.stat().st_size:
            unread = (f"the decisions in {wal.name} beside it are not read (its {shm.name} is missing and the "
                      "folder is read-only)")
        return base + "?mode=ro&immutable=1", unread
    if folder_writable and os.access(path, os.W_OK):
        return base + "?mode=rw", None
    return base + "?mode=ro&immutable=1", None


@contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """A short write transaction that takes the write lock up front, so waits go through the busy timeout."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def inspect(conn: sqlite3.Connection) -> tuple[int, str, set[str]]:
    """(user_version, autosel version that wrote the schema, tables); raises Corrupt if quick_check fails."""
    check = conn.execute("PRAGMA quick_check(3)").fetchone()[0]  # at most three findings: a damaged file has
    if check != "ok":  # hundreds, each a line, and the message names the file's state, not every page
        findings = check.replace("*** in database main ***\n", "").splitlines()
        raise Corrupt(f"quick_check: {'; '.join(findings)}")
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    written_by = "unknown"
    if "meta" in tables:
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_written_by'").fetchone()
        written_by = row[0] if row else written_by
    return version, written_by, tables


def migrated(conn: sqlite3.Connection) -> bool:
    """Whether migrate() has nothing to write: the schema is current and the file carries autosel's mark."""
    return (conn.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION
            and conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID)


def migrate(conn: sqlite3.Connection, *, written_by: str | None = None) -> None:
    """Bring a writable autosel file (or a new one, or :memory:) to SCHEMA_VERSION and stamp APPLICATION_ID;
    safe when several processes do it at once. Callers check identify() first: this writes.
    written_by: the autosel version stamped in meta (default: this one; a reproducible build passes its own)."""
    if migrated(conn):
        return
    db = writer(conn)
    with immediate(conn):
        current = conn.execute("PRAGMA user_version").fetchone()[0]  # re-read under the write lock
        if current < SCHEMA_VERSION:
            for target in range(current + 1, SCHEMA_VERSION + 1):
                MIGRATIONS[target](db)
            stamp = written_by or autosel_version()
            if current == 0:
                db["meta"].upsert({"key": "created_by", "value": stamp}, pk="key")
            db["meta"].upsert({"key": "schema_written_by", "value": stamp}, pk="key")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")


def decision_row(decision: Decision) -> dict[str, str]:
    key = decision.key
    return {"platform_key": key.platform_key, "op": key.op, "mode": key.mode, "bucket": key.bucket,
            "versions_hash": key.versions_hash, "winner": decision.winner, "created_at": decision.created_at,
            "autosel_version": decision.autosel_version, "evidence": decision.to_json()}


def _expect(value: object, kinds: tuple[type, ...], what: str, *, optional: bool = False) -> None:
    if (value is None and optional) or (isinstance(value, kinds) and not isinstance(value, bool)):
        return
    names = " or ".join(k.__name__ for k in kinds) + (" or null" if optional else "")
    raise ValueError(f"{what} is {value!r} ({type(value).__name__}), expected {names}")


def check_evidence(decision: Decision) -> Decision:
    """The decision if every field has its type (numbers are numbers, names are text); else ValueError naming
    the field. Rows are data: a string where a score belongs must not reach the commands that format it."""
    number, text = (int, float), (str,)
    _expect(decision.winner, text, "winner")
    if not decision.winner:
        raise ValueError("winner is empty")
    _expect(decision.margin, number, "margin")
    _expect(decision.tune_s, number, "tune_s")
    _expect(decision.lead_over_runner_up, number, "lead_over_runner_up", optional=True)
    _expect(decision.runner_up, text, "runner_up", optional=True)
    for name in ("method", "created_at", "autosel_version", "checked_with"):
        _expect(getattr(decision, name), text, name)
    for name, version in decision.versions.items():
        _expect(name, text, "a versions key")
        _expect(version, text, f"versions[{name!r}]")
    for part, digest in decision.fingerprint.items():
        _expect(part, text, "a fingerprint part")
        _expect(digest, text, f"fingerprint[{part!r}]")
    for pair in decision.per_shape_winners:
        if len(pair) != 2:
            raise ValueError(f"per_shape_winners entry {pair!r} is not a (shape, backend) pair")
        _expect(pair[0], text, "a per-shape winner's shape")
        _expect(pair[1], text, "a per-shape winner's backend")
    for c in decision.candidates:
        _expect(c.backend, text, "a candidate's backend")
        _expect(c.status, text, f"{c.backend}'s status")
        _expect(c.reason, text, f"{c.backend}'s reason", optional=True)
        _expect(c.score, number, f"{c.backend}'s score", optional=True)
        for s in c.shapes:
            for name in ("max_abs_err", "max_rel_err", "first_call_s"):
                _expect(getattr(s, name), number, f"{c.backend}'s {name}", optional=True)
            m = s.timing
            if m is None:
                continue
            for name in ("median_us", "p20_us", "p80_us", "mad_us"):
                _expect(getattr(m, name), number, f"{c.backend}'s {name}")
            for name in ("host_us", "device_us"):
                _expect(getattr(m, name), number, f"{c.backend}'s {name}", optional=True)
            _expect(m.samples, (int,), f"{c.backend}'s samples")
            _expect(m.method, text, f"{c.backend}'s timing method")
            for value in m.round_medians_us:
                _expect(value, number, f"{c.backend}'s round median")
    return decision


def parse_row(source: str, row: Sequence) -> Decision | None:
    """A Decision from (key columns..., evidence), or None (logged once) if the row is not valid data."""
    try:
        decision = Decision.from_json(row[len(KEY_COLUMNS)])
        check_evidence(decision)
        if decision.key != DecisionKey(*row[: len(KEY_COLUMNS)]):
            raise ValueError("its key columns do not match its evidence")
        return decision
    except Exception as exc:  # a row is data: whatever it holds, it must not crash a lookup
        said = state.process.said.bad_rows
        if (source, tuple(row[: len(KEY_COLUMNS)])) not in said:
            said.add((source, tuple(row[: len(KEY_COLUMNS)])))
            logger.warning("skipping an invalid row of %s with key %s: %s", source, tuple(row[:5]), exc)
        return None

FORMATS = ("sqlite", "jsonl")
PREFER = (None, "newest", "first")


def _sort_key(decision: Decision) -> tuple:
    return astuple(decision.key) + (decision.created_at,)


def output_file(out: Path) -> Path:
    """The file that writing `out` replaces: a symlink's target (the link stays), else `out` itself. A DatabaseError
    if that exists and is not a regular file: the write swaps a new file in with os.replace, which would put it in
    place of a link, a device node or a FIFO instead of writing through them."""
    out = Path(out)
    target = out
    if out.is_symlink():
        try:
            target = out.resolve()
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
            raise DatabaseError(f"cannot follow the link {out} ({exc}); choose another output path") from exc
    kind = special_kind(target)
    if kind is None:  # a regular file, not there yet (written new), or not reachable (the write says why)
        return target
    shown = f"{out} (a link to {target})" if target != out else str(out)
    raise DatabaseError(f"{shown} is {kind}, not a regular file, so it was left as it is; choose another output path "
                        "(a regular file, or one that does not exist yet)")


def nearest_existing(path: Path) -> Path | None:
    """The closest of `path`'s parents that exists: the folder a new file there goes into, or a file in the way."""
    return next((folder for folder in Path(path).parents if folder.exists()), None)


def why_unwritable(path: Path, exc: BaseException) -> str:
    """Why `path` could not be written, from the error that said so: where one of the folders it needs exists as a
    file, that (the system says only "File exists" or "Not a directory"), else the error's own text."""
    folder = nearest_existing(path)
    if folder is not None and not folder.is_dir():
        return f"{folder} is a file, not a folder"
    return getattr(exc, "strerror", None) or str(exc)


def _new_output(out: Path, overwrite: bool, how: str) -> Path:
    """The file that writing `out` replaces (output_file); one that exists is refused unless overwrite is true
    (`how`: the way to overwrite it on purpose, for the message)."""
    target = output_file(out)
    if target.exists() and not overwrite:
        raise DatabaseError(f"{out} already exists; not overwriting it. Choose another output path, "
                            f"or overwrite it on purpose ({how}).")
    return target


def export_decisions(rows: Iterable[Decision], out: Path, *, fmt: str, overwrite: bool = False) -> int:
    """Write decisions, from one source, to a new file: whole tuning tables (first_tables). Returns how many rows
    were written. A symlink at `out` is written through (its target is replaced, the link stays)."""
    if fmt not in FORMATS:
        raise DatabaseError(f"unknown export format {fmt!r}; use one of: {', '.join(FORMATS)}")
    out = Path(out)
    target = _new_output(out, overwrite, "overwrite=True, `--force` on the command line")
    ordered = first_tables([rows])
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")  # beside the file replaced: same file system
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise DatabaseError(f"cannot write {out} ({why_unwritable(target, exc)}); choose a writable output path"
                            ) from exc
    try:
        if fmt == "jsonl":
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(d.to_json() + "\n" for d in ordered)
        else:
            conn = connect(str(tmp))
            try:
                conn.execute("PRAGMA journal_mode = DELETE")  # a single file that can ship read-only
                migrate(conn)
                with immediate(conn):
                    writer(conn)["decisions"].upsert_all(
                        [decision_row(d) for d in ordered], pk=KEY_COLUMNS)
            finally:
                conn.close()
        os.replace(tmp, target)  # readers never see a half-written export
    except BaseException as exc:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(exc, (OSError, sqlite3.OperationalError)):  # a folder one may list but not write to, a full disk
            raise DatabaseError(f"cannot write {out} ({why_unwritable(target, exc)}); choose a writable output path"
                                ) from exc
        raise
    return len(ordered)


TableKey = tuple  # (platform_key, op, mode, versions_hash): one tune's op-level row and its bucket rows


def table_key(decision: Decision) -> TableKey:
    return decision.platform_key, decision.op, decision.mode, decision.key.versions_hash


def tables(rows: Iterable[Decision]) -> dict[TableKey, dict[str, Decision]]:
    """Rows grouped into tuning tables: table key -> bucket -> row (the first row of a key, if it comes twice)."""
    grouped: dict[TableKey, dict[str, Decision]] = {}
    for decision in rows:
        grouped.setdefault(table_key(decision), {}).setdefault(decision.bucket, decision)
    return grouped


def first_tables(sources: Iterable[Iterable[Decision]]) -> list[Decision]:
    """The rows of each table from the first source that holds its op-level row, in the written order: a table is
    written whole or not at all, as selection reads it (the op-level row's layer, then that layer's bucket rows),
    so that one tune's bucket rows never end up beside another tune's op-level row. Bucket rows without their
    op-level row are left out, with a warning: selection never reads them."""
    chosen: dict[TableKey, dict[str, Decision]] = {}
    orphans: set[TableKey] = set()
    for source in sources:
        for key, table in tables(source).items():
            if OP_LEVEL_BUCKET not in table:
                orphans.add(key)
            else:
                chosen.setdefault(key, table)
    _say_left_out(orphans - chosen.keys())
    return sorted((d for table in chosen.values() for d in table.values()), key=_sort_key)


def _say_left_out(orphans: set[TableKey]) -> None:
    """Warn of tables whose bucket rows are left out: no source holds their op-level row."""
    for key in sorted(orphans):
        logger.warning("left out the bucket rows of %s (%s mode, %s): their op-level row is not there, and "
                       "selection never reads bucket rows without it", key[1], key[2], key[0])


PAGE_SIZE = 4096  # fixed, so a reproducible build does not follow the SQLite library's default


def build_reproducible(rows: Iterable[Decision], out: Path, *, overwrite: bool = False) -> int:
    """Write decisions as a shipped SQLite file whose bytes depend only on the decisions and the SQLite library:
    sorted rows inserted in one transaction, a fixed page size, meta stamped with the newest row's autosel
    version (not this one's) and the SQLite version that laid the pages out, VACUUMed, DELETE journal mode.
    Returns how many rows were written; whole tables, as export_decisions writes them."""
    out = Path(out)
    target = _new_output(out, overwrite, "overwrite=True")
    ordered = first_tables([rows])
    if not ordered:
        raise DatabaseError(f"no decisions to write to {out}; a shipped DB must hold at least one")
    written_by = max(ordered, key=lambda d: (d.created_at, d.autosel_version)).autosel_version or "unknown"
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        conn = connect(str(tmp))
        try:
            conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")
            conn.execute("PRAGMA journal_mode = DELETE")
            migrate(conn, written_by=written_by)
            with immediate(conn):
                db = writer(conn)
                db["meta"].upsert({"key": "built_with_sqlite", "value": sqlite3.sqlite_version}, pk="key")
                db["decisions"].insert_all([decision_row(d) for d in ordered])
            conn.execute("VACUUM")
        finally:
            conn.close()
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(ordered)


def read_decisions(path: Path) -> list[Decision]:
    """Every valid decision of a tuning DB (.db) or a JSON Lines export; invalid rows are logged and skipped."""
    path = Path(path)
    try:
        with open_regular(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise DatabaseError(f"cannot read {path} ({exc.strerror or exc}); check the path") from exc
    if head == SQLITE_MAGIC:
        uri, unread = reading_uri(path)  # a tune's DB in a read-only folder too, and nothing left beside it
        if unread:
            logger.warning("%s: %s; copy it with its -shm, or export it where its folder is writable", path, unread)
        conn = None
        try:
            conn = connect(uri, uri=True)
            rows = conn.execute(f"SELECT {', '.join(ROW_COLUMNS)} FROM decisions").fetchall()
        except sqlite3.Error as exc:
            raise DatabaseError(f"{path} is not a readable autosel tuning DB ({exc}); "
                                "run `autosel doctor` on it or export it again") from exc
        finally:
            if conn is not None:
                conn.close()
        found = [parse_row(str(path), row) for row in rows]
        return sorted((d for d in found if d is not None), key=_sort_key)
    out, problems = [], []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if line.strip():
            try:
                out.append(check_evidence(Decision.from_json(line)))
            except Exception as exc:  # data, never code: a bad line is skipped, the rest still imports
                problems.append((n, line_problem(line, exc)))
    if problems and not out:
        n, problem = problems[0]
        raise DatabaseError(f"{path} is neither an autosel tuning DB (SQLite) nor a JSON Lines export of decisions: "
                            f"line {n} is {problem}; pass files written by `autosel export` or `autosel merge`")
    for n, problem in problems:
        logger.warning("%s:%d: skipping a line that is %s; each line must be one decision as "
                       "`autosel export --format jsonl` writes it", path, n, problem)
    return out


def line_problem(line: str, exc: Exception) -> str:
    """Why a JSON Lines line is not a decision, in the file's terms (not the dataclass constructor's)."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        return f"not valid JSON ({error.msg} at column {error.colno})"
    if not isinstance(data, dict):
        return f"not a JSON object (a {type(data).__name__})"
    required = [f.name for f in fields(Decision) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        return f"not a decision: it has no {', '.join(repr(m) for m in missing)}"
    return f"not a decision: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Conflict:
    """One key with different winners in different inputs: (source path, winner) for each row seen."""

    key: DecisionKey
    winners: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class MergeReport:
    rows: int
    conflicts: tuple[Conflict, ...]
    sources: tuple[str, ...]
    written: bool = True  # False: every table conflicted and was left out, so no file was written (nor replaced)
    bucket_rows: int = 0  # of `rows`, those of a shape bucket (the rest are op-level decisions)


def merge(inputs: Sequence[Path], out: Path, *, prefer: str | None = None, overwrite: bool = False,
          fmt: str | None = None) -> MergeReport:
    """Merge decisions of several DBs/exports into `out` (`fmt`, else .jsonl: JSON Lines, else SQLite), one
    tuning table (an op and mode's op-level row and bucket rows, per platform and versions) at a time: a table is
    written whole, never mixed with another tune's. Tables that agree (the same buckets, the same winners): the
    newest copy is kept. Tables that differ: a Conflict for each row that differs (a missing row is "-"), and the
    table is left out unless prefer="newest" (the newest op-level row's) or "first" (the earliest input's) says
    which to keep. Each input is read once; inputs with no decision at all are a DatabaseError and nothing is
    written. When nothing is left to write (every table left out), no file is written and an existing `out` stays
    as it was (MergeReport.written is False)."""
    if prefer not in PREFER:
        raise DatabaseError(f"prefer={prefer!r} is not valid; use None (leave conflicts out), 'newest' or 'first'")
    output_file(out)  # a FIFO or a device at `out` is refused before the inputs are read, not after
    seen: dict[TableKey, list[tuple[str, dict[str, Decision]]]] = {}
    orphans: set[TableKey] = set()
    for source in inputs:
        for key, table in tables(read_decisions(Path(source))).items():
            if OP_LEVEL_BUCKET in table:
                seen.setdefault(key, []).append((str(source), table))
            else:
                orphans.add(key)
    if not seen and not orphans:
        raise DatabaseError(f"none of {', '.join(map(str, inputs))} holds a decision, so {out} was not written; "
                            "check the inputs (autosel export writes them)")
    _say_left_out(orphans - seen.keys())
    kept, conflicts = [], []
    for found in seen.values():
        newest = max(found, key=lambda item: item[1][OP_LEVEL_BUCKET].created_at)[1]
        buckets = sorted({bucket for _, table in found for bucket in table})
        winners = {bucket: tuple((src, table[bucket].winner if bucket in table else "-") for src, table in found)
                   for bucket in buckets}
        differ = [bucket for bucket in buckets if len({w for _, w in winners[bucket]}) > 1]
        if differ:
            conflicts += [Conflict(replace(newest[OP_LEVEL_BUCKET].key, bucket=bucket), winners[bucket])
                          for bucket in differ]
            if prefer is None:
                continue
            newest = found[0][1] if prefer == "first" else newest
        kept += newest.values()
    conflicts.sort(key=lambda c: astuple(c.key))
    sources = tuple(str(s) for s in inputs)
    if not kept and not conflicts:
        raise DatabaseError(f"the decisions in {', '.join(sources)} are bucket rows without their op-level row, which "
                            f"selection never reads, so {out} was not written; re-tune those ops")
    if not kept:  # an empty file would replace an existing `out` (--force) or block the retry with prefer
        return MergeReport(rows=0, conflicts=tuple(conflicts), sources=sources, written=False)
    fmt = fmt or ("jsonl" if Path(out).suffix == ".jsonl" else "sqlite")
    rows = export_decisions(kept, Path(out), fmt=fmt, overwrite=overwrite)
    return MergeReport(rows=rows, conflicts=tuple(conflicts), sources=sources,
                       bucket_rows=sum(d.bucket != OP_LEVEL_BUCKET for d in kept))
