"""Shared fixtures: every test gets its own user DB and environment, and the selector's caches are reset."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def isolated_autosel(tmp_path, monkeypatch):
    for name in ("AUTOSEL_DB_PATH", "AUTOSEL_TUNE", "AUTOSEL_BACKEND", "AUTOSEL_MODE", "AUTOSEL_RECORD",
                 "AUTOSEL_BUDGET_S", "AUTOSEL_LOG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AUTOSEL_DB", str(tmp_path / "user.db"))
    from autosel import selector

    selector.clear_cache()
    yield
    selector.clear_cache()
