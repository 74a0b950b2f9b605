"""autosel.state: what a process remembers is one object that clear_cache() empties, a test replaces, and a forked
child starts from with new locks and no agreements."""

from __future__ import annotations

import os
import select
import threading
from typing import Callable

import pytest

import autosel
from autosel import KernelBackend as B, KernelSpec, state
from autosel.registry import KernelRegistry
from conftest import use_registry


@pytest.fixture
def one_op(monkeypatch):
    reg = KernelRegistry()
    use_registry(monkeypatch, reg)
    reg.register(KernelSpec("mine.op", B.TORCH, "operator:neg"))
    return reg


def test_get_kernel_caches_in_the_current_state_and_clear_cache_empties_it(one_op):
    kernel = autosel.get_kernel("mine.op")
    cache = state.process.kernels
    assert cache.kernels == {("mine.op", None, None): kernel}
    state.process.agreements.chosen_alone.add("mine.op")
    state.process.agreements.agreed[("mine.op", "eager", "cpu")] = "torch"
    autosel.clear_cache()
    assert cache.kernels == {} and cache.generation == 1
    assert not state.process.agreements.chosen_alone and not state.process.agreements.agreed


def test_a_replaced_state_shares_nothing_with_the_one_it_replaces(one_op):
    autosel.get_kernel("mine.op")
    before = state.process
    previous = state.use(state.ProcessState())
    try:
        assert previous is before and state.process.kernels.kernels == {}
        autosel.get_kernel("mine.op")
        state.process.memos.announced.add(("mine.op", "eager"))
        assert before.memos.announced == set()
    finally:
        state.use(previous)
    assert list(state.process.kernels.kernels) == [("mine.op", None, None)]


def test_forked_keeps_kernels_and_memos_with_new_locks_and_no_agreements():
    parent = state.ProcessState()
    parent.kernels.kernels[("mine.op", None, None)] = abs
    parent.memos.announced.add(("mine.op", "eager"))
    parent.agreements.agreed[("mine.op", "eager", "cpu")] = "torch"
    parent.kernels.lock.acquire()
    child = parent.forked()
    assert child.kernels.kernels == {("mine.op", None, None): abs} and child.memos.announced == {("mine.op", "eager")}
    assert child.agreements.agreed == {} and not child.kernels.lock.locked()
    parent.kernels.lock.release()


def child_says(report: Callable[[], str]) -> str:
    """Fork; the child writes report() to a pipe and leaves without running the parent's atexit hooks. Its answer, or
    a sentence saying none came within 60 s (the child is then killed: it hung)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write_end, report().encode())
        finally:
            os._exit(0)
    os.close(write_end)
    ready, _, _ = select.select([read_end], [], [], 60)
    answer = os.read(read_end, 100).decode() if ready else "no answer within 60 s"
    os.close(read_end)
    if not ready:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    return answer


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_hang_on_a_lock_held_at_the_fork(one_op):
    # A lock held at the fork (by another thread of a serving engine, say) stayed held in the child for ever: its
    # first clear_cache or lookup that takes the lock would hang.
    kernel = autosel.get_kernel("mine.op")
    state.process.agreements.agreed[("mine.op", "eager", "cpu")] = "torch"

    def report() -> str:
        seen = state.process
        kept = seen.kernels.kernels.get(("mine.op", None, None)) is kernel
        autosel.clear_cache()  # takes the kernel cache's lock
        return f"{kept} {seen.agreements.agreed == {}}"

    with state.process.kernels.lock:
        answer = child_says(report)
    assert answer == "True True"
    assert state.process.agreements.agreed  # the parent's own agreements are its own


def test_clear_cache_gives_the_tuning_dbs_warnings_again(tmp_path, caplog):
    from autosel.db.files import warn_once
    from autosel.db.tools import parse_row

    with pytest.warns(RuntimeWarning, match="is read-only"):
        warn_once(tmp_path / "user.db", "readonly", "tuning DB user.db is read-only")
    warn_once(tmp_path / "user.db", "readonly", "tuning DB user.db is read-only")  # said: silent
    assert parse_row("ship.db", ("p", "x.op", "eager", "*", "h", "{not json")) is None
    assert parse_row("ship.db", ("p", "x.op", "eager", "*", "h", "{not json")) is None
    assert len([r for r in caplog.records if "skipping an invalid row" in r.message]) == 1
    autosel.clear_cache()
    with pytest.warns(RuntimeWarning, match="is read-only"):
        warn_once(tmp_path / "user.db", "readonly", "tuning DB user.db is read-only")
    assert parse_row("ship.db", ("p", "x.op", "eager", "*", "h", "{not json")) is None
    assert len([r for r in caplog.records if "skipping an invalid row" in r.message]) == 2


def test_clear_cache_gives_decidings_warnings_again(caplog):
    # Deciding's warnings given once (an outdated decision kept untimed) outlived clear_cache, unlike the DB's.
    from types import SimpleNamespace

    from autosel import tuning

    decision = SimpleNamespace(winner="torch")
    for _ in range(2):
        tuning._say_untimed("x.op", "eager", decision, "was tuned elsewhere", "AUTOSEL_TUNE=off")
    assert len([r for r in caplog.records if "it is kept, since nothing can be timed" in r.message]) == 1
    autosel.clear_cache()
    tuning._say_untimed("x.op", "eager", decision, "was tuned elsewhere", "AUTOSEL_TUNE=off")
    assert len([r for r in caplog.records if "it is kept, since nothing can be timed" in r.message]) == 2


def test_clear_cache_has_autosel_record_append_each_shape_again(tmp_path, caplog):
    from autosel.dispatch import recording

    path = tmp_path / "record.jsonl"
    recorded = recording("x.double", lambda x: 2 * x, path, "eager", lambda x: {"n": x})
    assert [recorded(3), recorded(3)] == [6, 6]
    assert len(path.read_text().splitlines()) == 1  # once per process...
    recording("x.unshaped", abs, path, "eager", None)
    autosel.clear_cache()
    recorded(3)
    assert len(path.read_text().splitlines()) == 2  # ...until clear_cache()
    recording("x.unshaped", abs, path, "eager", None)
    assert len([r for r in caplog.records if "declares no shape_of" in r.message]) == 2


def test_clear_cache_reads_edited_code_again_for_fingerprints(tmp_path, monkeypatch):
    from autosel import staleness

    (tmp_path / "edited_kernels.py").write_text("def kernel(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = staleness.identities.of_target("edited_kernels", "kernel")
    (tmp_path / "edited_kernels.py").write_text("def kernel(x):\n    return x + 2\n")
    assert staleness.identities.of_target("edited_kernels", "kernel") == before  # read once per process...
    autosel.clear_cache()
    assert staleness.identities.of_target("edited_kernels", "kernel") not in (before, None)  # ...until clear_cache()


def test_the_group_the_ranks_agree_in_outlives_clear_cache_but_not_a_fork():
    # A setting, not a memo: forgetting it would have a pipeline stage's next selection wait on every rank.
    group = object()  # stands for set_group's process group, which needs torch.distributed up
    state.process.agreements.chosen_group = group
    autosel.clear_cache()
    assert state.process.agreements.chosen_group is group
    assert state.process.forked().agreements.chosen_group is None  # the child is no rank of that group


def test_forked_gives_new_locks_to_everything_it_keeps():
    parent = state.ProcessState()
    parent.recorder.recorded.add(("x.op", "eager", "{}"))
    parent.derived.meta_keys[("make", "bucket", "{}")] = (1,)
    held = [parent.recorder.lock, parent.derived.lock, parent.locks.plugins, parent.locks.log_handler,
            parent.locks.custom_ops]
    for lock in held:
        lock.acquire()
    child = parent.forked()
    assert child.recorder.recorded == parent.recorder.recorded and child.derived.meta_keys == parent.derived.meta_keys
    assert not any(lock in held for lock in (child.recorder.lock, child.derived.lock, child.locks.plugins,
                                             child.locks.log_handler, child.locks.custom_ops))
    for lock in (child.recorder.lock, child.derived.lock, child.locks.log_handler, child.locks.custom_ops):
        assert lock.acquire(blocking=False)
    for lock in held:
        lock.release()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_hang_on_the_registrys_locks_held_at_the_fork():
    # The registry's lock and plug-in loading's, held by another thread at the fork, stayed held in the child.
    from autosel.registry import registry

    held, done = threading.Event(), threading.Event()

    def hold():
        with registry._lock, state.process.locks.plugins:
            held.set()
            done.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(60)

    def report() -> str:
        with state.process.locks.plugins:
            return str("layernorm.rmsnorm" in registry.ops())

    try:
        assert child_says(report) == "True"
    finally:
        done.set()
        holder.join()
