"""Every AUTOSEL_* variable: defaults, parsing, and errors that name the variable and the allowed values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autosel import state
from autosel.config import read_settings, unknown_op_problems
from autosel.errors import ConfigError
from autosel.spec import KernelBackend as B


def test_defaults():
    settings = read_settings({})
    assert settings.tune == "auto" and settings.mode is None and settings.forced_backend is None
    assert settings.db.name == "tuning.db" and "autosel" in str(settings.db)
    assert settings.db_path == () and settings.record is None and settings.budget_s == 30.0
    assert settings.match == "exact" and settings.check_ranks is False


def test_values_are_parsed():
    settings = read_settings({"AUTOSEL_DB": "/tmp/x.db", "AUTOSEL_DB_PATH": "/a.db:/b", "AUTOSEL_TUNE": "OFF",
                              "AUTOSEL_MODE": "graph", "AUTOSEL_BUDGET_S": "12.5", "AUTOSEL_RECORD": "/tmp/r.jsonl"})
    assert settings.db == Path("/tmp/x.db") and settings.db_path == (Path("/a.db"), Path("/b"))
    assert (settings.tune, settings.mode, settings.budget_s) == ("off", "graph", 12.5)
    assert settings.record == Path("/tmp/r.jsonl")
    assert [read_settings({"AUTOSEL_MATCH": m}).match for m in ("exact", "Device", " arch ")] == ["exact", "device",
                                                                                                   "arch"]
    assert [read_settings({"AUTOSEL_CHECK_RANKS": v}).check_ranks for v in ("0", "1", "off", "ON", " on ")] == [
        False, True, False, True, True]


def test_forced_backend_global_and_per_op():
    assert read_settings({"AUTOSEL_BACKEND": "triton"}).forced_backend_for("x.y") == (B.TRITON, False)
    settings = read_settings({"AUTOSEL_BACKEND": "a.b=torch, c.d=flashinfer"})
    assert settings.forced_backend_for("c.d") == (B.FLASHINFER, True)
    assert settings.forced_backend_for("x.y") == (None, False)


@pytest.mark.parametrize("env, message", [
    ({"AUTOSEL_TUNE": "yes"}, "AUTOSEL_TUNE='yes' is not valid; allowed values: auto, off, force"),
    ({"AUTOSEL_MODE": "prefill"}, "AUTOSEL_MODE='prefill' is not valid; allowed values: eager, graph"),
    ({"AUTOSEL_LOG": "loud"}, "AUTOSEL_LOG='loud' is not valid; allowed values: debug, info, warning, error"),
    ({"AUTOSEL_MATCH": "model"}, "AUTOSEL_MATCH='model' is not valid; allowed values: exact, device, arch"),
    ({"AUTOSEL_CHECK_RANKS": "yes"}, "AUTOSEL_CHECK_RANKS='yes' is not valid; allowed values: 0, 1, off, on"),
    ({"AUTOSEL_BACKEND": "cuda"}, "AUTOSEL_BACKEND: unknown kernel backend 'cuda'"),
    ({"AUTOSEL_BACKEND": "a.b=torch,c.d"}, "AUTOSEL_BACKEND item 'c.d' is not 'op=backend'"),
    ({"AUTOSEL_BUDGET_S": "-1"}, "AUTOSEL_BUDGET_S='-1' is not a positive finite number of seconds"),
    # nan and inf used to be accepted, and the budget never ended:
    ({"AUTOSEL_BUDGET_S": "nan"}, "AUTOSEL_BUDGET_S='nan' is not a positive finite number of seconds"),
    ({"AUTOSEL_BUDGET_S": "inf"}, "AUTOSEL_BUDGET_S='inf' is not a positive finite number of seconds"),
    # These used to raise RuntimeError and OSError (File name too long) from the DB code:
    ({"AUTOSEL_DB_PATH": "~nosuchuser/x.db"}, "AUTOSEL_DB_PATH='~nosuchuser/x.db': there is no home folder for "
                                              "'~nosuchuser'"),
    ({"AUTOSEL_DB": "~nosuchuser/x.db"}, "AUTOSEL_DB='~nosuchuser/x.db': there is no home folder"),
    ({"AUTOSEL_DB": "/tmp/" + "a" * 300 + ".db"}, "AUTOSEL_DB: the name 'aaaa"),
    ({"AUTOSEL_RECORD": "/tmp/" + "r" * 300}, "AUTOSEL_RECORD: the name 'rrrr"),
    # An SQLite URI was taken as a relative path, and a folder named "file:" was made in the working directory:
    ({"AUTOSEL_DB": "file:/tmp/x.db"}, "AUTOSEL_DB='file:/tmp/x.db' is an SQLite URI; autosel takes a file path and "
                                       "opens it as it needs (read-only where it only reads): set AUTOSEL_DB=/tmp/x.db, "
                                       "or AUTOSEL_DB=./file:/tmp/x.db for a file whose name begins with 'file:'"),
    ({"AUTOSEL_DB_PATH": "file:///opt/db?mode=ro"}, "AUTOSEL_DB_PATH='file:///opt/db?mode=ro' is an SQLite URI; "
                                                    "autosel takes a file path and opens it as it needs (read-only "
                                                    "where it only reads): set AUTOSEL_DB_PATH=/opt/db,"),
])
def test_bad_values_name_the_variable_and_what_is_allowed(env, message):
    with pytest.raises(ConfigError) as info:
        read_settings(env)
    assert str(info.value).startswith(message)
    assert isinstance(info.value, ValueError)  # callers catching ValueError keep working


@pytest.mark.parametrize("ops, problems", [
    (["layernorm.rmsnorm"], []),
    (["layernorm.rmsnrom"], ["AUTOSEL_BACKEND names op 'layernorm.rmsnrom', which is not registered here (did you "
                             "mean layernorm.rmsnorm?)"]),
    (["zzz"], ["AUTOSEL_BACKEND names op 'zzz', which is not registered here (registered ops: gemm.mm, "
               "layernorm.rmsnorm)"]),
])
def test_an_autosel_backend_op_that_is_not_registered_is_named_with_the_nearest(ops, problems):
    # A misspelt op in AUTOSEL_BACKEND was accepted silently and forced nothing.
    assert unknown_op_problems(ops, ["gemm.mm", "layernorm.rmsnorm"]) == problems


def test_selection_warns_once_of_an_autosel_backend_op_that_is_not_registered(monkeypatch, caplog):
    # Selection took AUTOSEL_BACKEND=layernorm.rmsnrom=torch silently: the typo forced nothing and said nothing.
    import importlib

    from autosel import config
    from autosel.spec import KernelSpec

    registry_module = importlib.import_module("autosel.registry")  # `autosel.registry` the name is the object
    fresh = registry_module.KernelRegistry()
    fresh.register(KernelSpec("layernorm.rmsnorm", B.TORCH, "m:f"))
    monkeypatch.setattr(registry_module, "registry", fresh)
    monkeypatch.setattr(state.process.memos, "forced_ops_checked", set())
    monkeypatch.setenv("AUTOSEL_BACKEND", "layernorm.rmsnrom=torch,layernorm.rmsnorm=torch")
    with caplog.at_level("WARNING", logger="autosel.config"):
        config.settings()
        config.settings()
    assert [r.getMessage() for r in caplog.records] == [
        "AUTOSEL_BACKEND names op 'layernorm.rmsnrom', which is not registered here (did you mean "
        "layernorm.rmsnorm?); this entry forces nothing until such an op is registered. Correct the op name in "
        "AUTOSEL_BACKEND, or remove the entry"]


LIBRARY_SCRIPT = """
import logging
import autosel
from autosel import KernelBackend as B, KernelSpec
autosel.register_kernel(KernelSpec("mine.op", B.TORCH, "m:a"))
autosel.register_kernel(KernelSpec("mine.op", B.TRITON, "m:b"))
autosel.select_kernel("mine.op")
autosel.select_kernel("mine.op")
print(len(logging.getLogger("autosel").handlers))
"""


@pytest.mark.parametrize("level, handlers, stderr", [
    ("debug", 1, "autosel: INFO: op 'mine.op': AUTOSEL_BACKEND forces 'triton'\n" * 2),
    ("info", 1, "autosel: INFO: op 'mine.op': AUTOSEL_BACKEND forces 'triton'\n" * 2),
    ("warning", 1, ""),  # the level filters: an info line is not shown
    (None, 0, ""),  # unset: a library adds no handler
])
def test_autosel_log_in_a_script_logs_to_stderr_through_one_handler(level, handlers, stderr):
    # A script's AUTOSEL_LOG=debug set the level but added no handler, so nothing was shown.
    env = {k: v for k, v in os.environ.items() if k != "AUTOSEL_LOG"}
    env.update({"AUTOSEL_BACKEND": "mine.op=triton"}, **({"AUTOSEL_LOG": level} if level else {}))
    result = subprocess.run([sys.executable, "-c", LIBRARY_SCRIPT], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (int(result.stdout), result.stderr) == (handlers, stderr)
