"""The shipped tuning DBs (tuning_db/) and the tool that builds them: text and binary agree, byte for byte."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from autosel.db import TuningDB
from autosel.db.tools import APPLICATION_ID, SCHEMA_VERSION, read_decisions
from autosel.decisions import Decision

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "tuning_db"
TEXTS = sorted(FOLDER.glob("*.jsonl"))
TOOL = REPO / "tools" / "build_tuning_db.py"


def tool(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env, timeout=120)


def built_with(db: Path) -> str:
    with sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True) as conn:
        return dict(conn.execute("SELECT key, value FROM meta"))["built_with_sqlite"]


def test_every_shipped_text_has_its_db_and_nothing_else_ships():
    assert TEXTS, "tuning_db/ ships no decisions"
    assert sorted(p.stem for p in FOLDER.glob("*.db")) == [p.stem for p in TEXTS]


@pytest.mark.parametrize("text", TEXTS, ids=lambda p: p.stem)
def test_shipped_text_is_canonical(text):
    lines = text.read_text(encoding="utf-8").splitlines()
    decisions = [Decision.from_json(line) for line in lines]
    assert [d.to_json() for d in decisions] == lines  # keys sorted, nothing but the decision on a line
    keys = [tuple(vars(d.key).values()) for d in decisions]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


@pytest.mark.parametrize("text", TEXTS, ids=lambda p: p.stem)
def test_every_shipped_bucket_row_is_the_bucket_its_shapes_fall_in_today(text):
    # A bucket function that changed (gemm.mm's weight became a name at commit c134b65) leaves rows under the old key,
    # which no call looks up: their buckets then run the op-level winner, silently.
    pytest.importorskip("torch")
    from autosel.decisions import parse_bucket
    from autosel.registry import registry

    for decision in read_decisions(text):
        if decision.bucket == "*":
            continue
        definition = registry.definition(decision.op)
        for shape in {json.dumps(s.shape, sort_keys=True) for c in decision.candidates for s in c.shapes}:
            inputs = definition.make_inputs(json.loads(shape), "meta")  # shapes only: nothing allocated
            assert definition.bucket(*inputs) == parse_bucket(decision.bucket), (decision.op, decision.mode, shape)


@pytest.mark.parametrize("text", TEXTS, ids=lambda p: p.stem)
def test_shipped_db_holds_exactly_its_text(text):
    db = text.with_suffix(".db")
    assert read_decisions(db) == read_decisions(text)
    with sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    with TuningDB.open(None, [db], include_package=False, read_only=True) as layers:
        assert [(layer.kind, layer.rows, layer.problem) for layer in layers.layers[1:]] == [
            ("shipped", len(read_decisions(text)), None)]


def test_the_tool_rebuilds_every_shipped_db_byte_for_byte(tmp_path):
    if {built_with(t.with_suffix(".db")) for t in TEXTS} != {sqlite3.sqlite_version}:
        pytest.skip(f"the shipped DBs were built with SQLite {[built_with(t.with_suffix('.db')) for t in TEXTS]}, "
                    f"this is {sqlite3.sqlite_version}: pages may be laid out otherwise (rows compared above)")
    for text in TEXTS:
        shutil.copy(text, tmp_path / text.name)
    result = tool("--folder", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for text in TEXTS:
        assert (tmp_path / text.with_suffix(".db").name).read_bytes() == text.with_suffix(".db").read_bytes()
    assert tool("--check").returncode == 0


def test_check_fails_when_a_db_is_not_what_its_text_builds(tmp_path):
    text = tmp_path / "one.jsonl"
    lines = TEXTS[0].read_text(encoding="utf-8").splitlines()
    text.write_text("\n".join(lines[:2]) + "\n", encoding="utf-8")
    assert tool("--folder", str(tmp_path)).returncode == 0
    text.write_text(lines[0] + "\n", encoding="utf-8")  # the text changed, the .db was not rebuilt
    result = tool("--folder", str(tmp_path), "--check")
    assert result.returncode == 1 and "not what their text builds" in result.stderr


def test_a_line_that_is_not_a_decision_is_an_error_not_a_skipped_row(tmp_path):
    text = tmp_path / "bad.jsonl"
    text.write_text(TEXTS[0].read_text(encoding="utf-8").splitlines()[0] + "\n{\"op\": 1}\n", encoding="utf-8")
    result = tool("--folder", str(tmp_path))
    assert result.returncode == 1 and "1 of 2 lines are not decisions" in result.stderr
    assert not (tmp_path / "bad.db").exists()


def test_from_a_tune_writes_the_text_of_one_platform(tmp_path):
    decisions = read_decisions(TEXTS[0])
    other = Decision(**{**vars(decisions[0]), "platform_key": "cuda/sm_80/NVIDIA_A100/108"})
    source = tmp_path / "tune.jsonl"
    source.write_text("".join(d.to_json() + "\n" for d in [other, *decisions]), encoding="utf-8")
    out = tmp_path / "ship"
    out.mkdir()
    result = tool("--folder", str(out), "--from", str(source), "--name", "x", "--platform", decisions[0].platform_key)
    assert result.returncode == 0, result.stderr
    assert read_decisions(out / "x.jsonl") == read_decisions(out / "x.db") == sorted(
        decisions, key=lambda d: tuple(vars(d.key).values()) + (d.created_at,))
    assert json.loads((out / "x.jsonl").read_text().splitlines()[0])["platform_key"] == decisions[0].platform_key


def test_from_a_missing_file_is_one_line_not_a_traceback(tmp_path):
    # Used to break: the DatabaseError's traceback.
    result = tool("--folder", str(tmp_path), "--from", str(tmp_path / "missing.db"), "--name", "x")
    assert result.returncode == 1 and result.stderr == (f"--from: cannot read {tmp_path / 'missing.db'} (No such file "
                                                        "or directory); check the path\n")


@pytest.mark.parametrize("text", TEXTS, ids=lambda p: p.stem)
def test_every_shipped_row_carries_the_fingerprint_of_todays_code(text):
    # Shipped rows without one were judged at every start-up by rebuilding their bucket keys on meta tensors, which
    # imported torch._dynamo (about 1.5 s) before a plain-torch winner could run.
    from autosel import staleness
    from autosel.registry import load_plugins, registry

    load_plugins()
    for decision in read_decisions(text):
        assert decision.fingerprint, (decision.op, decision.mode, decision.bucket)
        if decision.bucket == "*":
            timed = {c.backend for c in decision.candidates}
            now = staleness.fingerprint(registry.definition(decision.op), [
                s for s in registry.get(decision.op) if s.backend.value in timed],
                staleness.platform_of_key(decision.platform_key))
            assert staleness.changed_parts(decision.fingerprint, now) == [], (decision.op, decision.mode)


def test_the_tool_fingerprints_rows_stored_without_one_and_check_names_those_it_cannot(tmp_path):
    pytest.importorskip("torch")
    rows = [json.loads(line) for line in TEXTS[0].read_text(encoding="utf-8").splitlines()]
    for row in rows:
        del row["fingerprint"]
    text = tmp_path / "old.jsonl"
    text.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows), encoding="utf-8")
    result = tool("--folder", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert [d.fingerprint for d in read_decisions(text)] == [d.fingerprint for d in read_decisions(TEXTS[0])]
    assert tool("--folder", str(tmp_path), "--check").returncode == 0
    bucket = next(row for row in rows if row["bucket"] != "*")  # keyed otherwise than its bucket function keys it
    bucket["bucket"] = json.dumps([12345] + json.loads(bucket["bucket"])[1:])
    text.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows), encoding="utf-8")
    result = tool("--folder", str(tmp_path))
    assert result.returncode == 1 and "rows without a fingerprint" in result.stderr
    assert f"{bucket['op']} ({bucket['mode']}" in result.stderr
    assert tool("--folder", str(tmp_path), "--check").returncode == 1
