"""Paths that are not regular files (FIFOs above all) are refused by every reader without being opened."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from autosel import cli, dispatch, state
from autosel.cli._tune import read_record, read_shapes_file
from autosel.db import TuningDB, read_decisions
from autosel.errors import DatabaseError
from autosel.files import NotRegularFile, check_regular, open_regular, special_kind


def finishes(fifo: Path, fn, timeout_s: float = 30.0):
    """fn()'s result, or a test failure if it is still waiting on `fifo` after timeout_s (then the FIFO is opened
    for writing and closed, which lets a reader blocked on it go on, so the test run does not hang)."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_RDWR))  # O_RDWR never blocks on Linux and releases an opener waiting on it
        thread.join(timeout_s)
        pytest.fail(f"still waiting on the FIFO {fifo} after {timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def test_special_kind_names_what_a_path_is_without_opening_it(tmp_path):
    fifo, regular, link = tmp_path / "f", tmp_path / "r", tmp_path / "l"
    os.mkfifo(fifo)
    regular.write_text("x")
    link.symlink_to(fifo)
    assert special_kind(fifo) == special_kind(link) == "a FIFO (named pipe)"
    assert special_kind(tmp_path) == "a folder"
    assert special_kind("/dev/null") == "a character device"
    assert special_kind(regular) is None and special_kind(tmp_path / "missing") is None
    with pytest.raises(NotRegularFile, match="is a FIFO \\(named pipe\\), not a regular file, so it was not opened"):
        check_regular(link)
    with pytest.raises(OSError):  # every reader's `except OSError` handles it
        open_regular(fifo, "a")
    assert open_regular(regular).read() == "x"


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe.db"
    os.mkfifo(path)
    return path


# Each of these waited on the FIFO for good (os.open blocks until a writer comes), in the user DB's file inspection,
# the shipped DBs' WAL-mode check, read_decisions (merge inputs), the recorder and the shape-file readers.
def test_a_fifo_as_the_user_db_is_a_problem_of_the_layer_for_every_opener(fifo):
    for read_only in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            db = finishes(fifo, lambda: TuningDB.open(fifo, include_package=False, read_only=read_only))
        user = [layer for layer in db.layers if layer.path == str(fifo)]
        problems = [layer.problem for layer in db.layers] + [str(w.message) for w in caught]
        assert any("is a FIFO (named pipe), not a regular file" in (p or "") for p in problems), problems
        assert all(layer.rows == 0 for layer in user)
        db.close()
    assert fifo.is_fifo()


def test_a_fifo_in_a_shipped_folder_and_named_directly_is_skipped_with_a_warning_saying_what_it_is(fifo, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        db = finishes(fifo, lambda: TuningDB.open(tmp_path / "user.db", [fifo.parent, fifo], include_package=False))
        assert db.decisions() == []
    messages = [str(w.message) for w in caught]
    assert any(f"shipped tuning DB {fifo} is unreadable ({fifo} is a FIFO (named pipe)" in m for m in messages), messages
    assert any(f"shipped tuning DB path {fifo} is a FIFO (named pipe), not a file or folder of *.db" in m
               for m in messages), messages
    assert [layer.kind for layer in db.layers] == ["user"]
    db.close()


def test_a_fifo_as_a_merge_input_is_a_database_error(fifo):
    with pytest.raises(DatabaseError, match="is a FIFO \\(named pipe\\), not a regular file"):
        finishes(fifo, lambda: read_decisions(fifo))


def test_a_fifo_as_autosel_record_stops_recording_with_a_warning_and_the_call_runs(fifo, monkeypatch):
    monkeypatch.setattr(state.process, "recorder", state.Recorder())
    recorded = dispatch.recording("x.double", lambda x: 2 * x, fifo, "eager", lambda x: {"n": x})
    with pytest.warns(RuntimeWarning, match="AUTOSEL_RECORD: cannot append to .* is a FIFO"):
        assert finishes(fifo, lambda: recorded(3)) == 6
    assert recorded(4) == 8  # recording stopped: no second warning, no wait


@pytest.mark.parametrize("reader", [read_shapes_file, read_record])
def test_a_fifo_as_a_shapes_or_record_file_is_a_clear_error(fifo, reader):
    import click

    with pytest.raises(click.ClickException, match="is a FIFO \\(named pipe\\), not a regular file"):
        finishes(fifo, lambda: reader(fifo))


@pytest.mark.parametrize("args", [["show"], ["show", "--json"], ["doctor"], ["doctor", "--json"],
                                  ["report", "--out", "{tmp}/r.html"], ["export", "--out", "{tmp}/e.jsonl"],
                                  ["prune", "--dry-run"]])
def test_commands_given_a_fifo_as_the_user_db_return_and_say_what_it_is(fifo, monkeypatch, tmp_path, args):
    monkeypatch.setenv("AUTOSEL_DB", str(fifo))
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = finishes(fifo, lambda: CliRunner().invoke(cli.main, args))
    assert result.exit_code in (0, 1), result.output
    assert "is a FIFO (named pipe), not a regular file" in result.output + (result.stderr or ""), result.output
    assert fifo.is_fifo()
