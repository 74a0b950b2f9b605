"""Fuzz the public API and the AUTOSEL_* variables: whatever the values, only the documented exception types.

Documented: TypeError or ValueError for a bad value given to a constructor or register_* (ConfigError,
TuningError are ValueErrors), from select_kernel a KeyError for an unknown op or a backend the op lacks and a
ValueError for a name that is no backend, and a warning (not an exception) when a tuning DB path cannot be used.
Each test keeps to a few seconds (max_examples, no deadline).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from autosel import selector
from autosel.config import VARIABLES, read_settings
from autosel.db import TuningDB
from autosel.registry import KernelRegistry, register_kernel, register_op
from autosel.spec import CapabilityRequirement, KernelBackend, KernelSpec

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

anything = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.binary(max_size=8), st.lists(st.one_of(st.none(), st.integers(), st.text(max_size=8)), max_size=3),
    st.tuples(st.integers(), st.integers()), st.sampled_from(list(KernelBackend)),
    st.sampled_from([CapabilityRequirement.CUDA, CapabilityRequirement.cuda(min_sm=(8, 0)), print, len]),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
names = st.one_of(st.text(max_size=30), st.sampled_from(["toy.op", "torch", "triton", "m:f", "cuda", "", ":"]))


def _inputs(shape, device):
    return ()


def _ref(x):
    return x


@pytest.fixture
def fresh_registry(monkeypatch):
    registry = KernelRegistry()
    monkeypatch.setattr(sys.modules["autosel.registry"], "registry", registry)
    monkeypatch.setattr(selector, "registry", registry)
    monkeypatch.setattr(selector, "load_plugins", lambda: None)
    return registry


@FUZZ
@given(op=st.one_of(names, anything), backend=st.one_of(st.sampled_from(list(KernelBackend)), anything),
       target=st.one_of(st.just("m:f"), names, anything), capabilities=st.one_of(st.just(()), anything),
       requires=st.one_of(st.just(()), anything), description=st.one_of(st.just(""), anything))
def test_kernel_spec_raises_only_type_or_value_errors(op, backend, target, capabilities, requires, description):
    try:
        spec = KernelSpec(op, backend, target, capabilities=capabilities, requires=requires, description=description)
    except (TypeError, ValueError):
        return
    assert isinstance(spec.op, str) and isinstance(spec.target, str) and isinstance(spec.backend, KernelBackend)
    assert all(isinstance(c, CapabilityRequirement) for c in spec.capabilities)
    assert all(isinstance(r, str) and r for r in spec.requires)


@FUZZ
@given(device=st.one_of(names, anything), low=anything, high=anything)
def test_capability_requirement_raises_only_type_or_value_errors(device, low, high):
    try:
        cap = CapabilityRequirement(device, low, high)
    except (TypeError, ValueError):
        return
    assert cap.device.value in ("cuda", "hip", "npu", "xpu", "mps", "cpu")


@FUZZ
@given(op=st.one_of(names, anything), shapes=st.one_of(anything, st.just([{"n": 1}])),
       make_inputs=st.one_of(anything, st.just(_inputs)), reference=st.one_of(names, anything, st.just(_ref)),
       rtol=anything, atol=anything)
def test_register_op_raises_only_type_or_value_errors(fresh_registry, op, shapes, make_inputs, reference, rtol, atol):
    try:
        definition = register_op(op, shapes=shapes, make_inputs=make_inputs, reference=reference, rtol=rtol,
                                 atol=atol)
    except (TypeError, ValueError):
        return
    assert callable(definition.make_inputs)
    for tolerance in (definition.rtol, definition.atol):
        assert tolerance is None or 0 <= tolerance < float("inf")


@FUZZ
@given(value=anything)
def test_register_kernel_raises_only_type_or_value_errors(fresh_registry, value):
    with pytest.raises((TypeError, ValueError)):
        register_kernel(value)


@FUZZ
@given(env=st.dictionaries(st.sampled_from(sorted(VARIABLES)),
                           st.one_of(st.text(max_size=40), st.sampled_from(["nan", "inf", "-1", "0", "1e400",
                                                                             "~nosuchuser/x.db", "a" * 300, "off",
                                                                             "triton", "a=b,c", "graph"])),
                           max_size=4))
def test_autosel_variables_raise_only_config_errors(env):
    try:
        read_settings(env)
    except ValueError as exc:  # ConfigError is a ValueError
        assert type(exc).__name__ == "ConfigError", exc


@FUZZ
@given(op=st.one_of(names, st.just("toy.op")), backend=st.one_of(st.none(), names), mode=st.sampled_from(
    [None, "eager", "graph", "prefill"]))
def test_select_kernel_raises_only_key_or_value_errors(fresh_registry, op, backend, mode):
    fresh_registry.register(KernelSpec("toy.op", KernelBackend.TORCH, "m:f"))
    try:
        spec = selector.select_kernel(op, backend, mode=mode)
    except (KeyError, ValueError):
        return
    assert spec.op == op


@FUZZ
@given(name=st.text(alphabet=st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)),
                    min_size=1, max_size=300))
def test_tuning_db_with_any_file_name_warns_at_worst(tmp_path, name):
    if name in (".", ".."):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a name the file system refuses: decisions in memory
        try:
            db = TuningDB.open(tmp_path / name, include_package=False)
        except ValueError:
            return
        try:
            assert db.layers and db.layers[0].kind in ("user", "memory")
        finally:
            db.close()
    assert Path(tmp_path).is_dir()
