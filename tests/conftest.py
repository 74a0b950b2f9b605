"""Shared fixtures: every test gets its own user DB and environment, and a process state (autosel.state) of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def pytest_configure(config):
    """Without CUDA, triton is first imported with TRITON_INTERPRET=1 set (then the variable is put back).

    Triton decorates its own library's functions (tl.sum, tl.sigmoid, tl.zeros, ...) once, when it is imported, for
    the interpreter or not; tests/test_triton_kernels.py runs autosel's kernels under the interpreter, and had any
    test module imported triton before it, those kernels could not call them ("Cannot call @triton.jit'd outside of
    the scope of a kernel"): the suite passed only in the order that collected test_triton_kernels first."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
        import triton.experimental.gluon  # noqa: F401  (imported lazily by launches, it asserts the same mode)
    except ImportError:
        pass
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.fixture(autouse=True)
def isolated_autosel(tmp_path, monkeypatch):
    for name in ("AUTOSEL_DB_PATH", "AUTOSEL_TUNE", "AUTOSEL_BACKEND", "AUTOSEL_MODE", "AUTOSEL_RECORD",
                 "AUTOSEL_BUDGET_S", "AUTOSEL_LOG", "AUTOSEL_MATCH", "AUTOSEL_CHECK_RANKS",
                 "AUTOSEL_FAST_LAUNCH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AUTOSEL_DB", str(tmp_path / "user.db"))
    # The package's shipped DBs (tuning_db/) hold real decisions for CI's machine type; a test sees them only
    # when it asks for them (tests/test_tuning_db.py), so that a shipped row never answers another test's tune.
    from autosel import db

    monkeypatch.setattr(db, "package_folder", lambda: None)
    from autosel import selector, state

    selector.clear_cache()  # also drops the kernels compiled code reads from selector's attributes
    previous = state.use(state.ProcessState())  # caches, agreements and memos of this test's own
    yield
    state.use(previous)
    selector.clear_cache()


def use_registry(monkeypatch, fresh) -> None:
    """Selection, tuning, the ranks' agreement and the CLI all read this registry for the test (each module bound
    the global one)."""
    from autosel import batch, distributed, selector, tuning

    for module in (selector, tuning, distributed, batch):
        monkeypatch.setattr(module, "registry", fresh)


def fresh_registry(monkeypatch, platform):
    """A new registry that selection, tuning and the CLI read, on `platform`, with tests/ importable (toy_kernels)."""
    from pathlib import Path

    from autosel.registry import KernelRegistry

    fresh = KernelRegistry()
    use_registry(monkeypatch, fresh)
    use_platform(monkeypatch, platform)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    return fresh


def use_platform(monkeypatch, platform) -> None:
    """Every caller of autosel.platforms.current_platform() sees `platform`."""
    from autosel import platforms

    monkeypatch.setattr(platforms, "current_platform", lambda: platform)


def use_fresh_registry(monkeypatch, platform, *, builtin: bool = False, timer=None):
    """A registry of the test's own (with the built-in ops if asked), seen on `platform`, tuned with `timer` when
    given (every timer_for returns it)."""
    from autosel import timing
    from autosel.registry import KernelRegistry

    fresh = KernelRegistry()
    if builtin:
        from autosel.ops import register_builtin_ops

        register_builtin_ops(fresh)
    use_registry(monkeypatch, fresh)
    use_platform(monkeypatch, platform)
    if timer is not None:
        monkeypatch.setattr(timing, "timer_for", lambda device, mode: timer)
    return fresh


def run_snippet(document: str, heading: str, tmp_path) -> subprocess.CompletedProcess:
    """Run, as pasted, the first ```python block after `heading` in `document` (a path from the repository's root),
    with this checkout first on the path and a user DB of the test's own. The caller's PYTHONPATH stays after it:
    the GPU machine's packages (transformers 5.24 included) are on it, in /tmp/site (dev/gpu_env.sh)."""
    text = (ROOT / document).read_text(encoding="utf-8")
    section = text[text.index(heading):]
    script = tmp_path / "snippet.py"
    script.write_text(section[section.index("```python") + len("```python"):].split("```", 1)[0])
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, PYTHONPATH=path, AUTOSEL_DB=str(tmp_path / "user.db"))
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, cwd=tmp_path)
