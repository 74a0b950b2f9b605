"""KernelRegistry: registration order, idempotent identical registration, conflicts, copies, op definitions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from autosel.registry import KernelRegistry, register_op
from autosel.spec import KernelBackend as B, KernelSpec, OpDefinition


def test_register_get_has_ops_all_specs():
    reg = KernelRegistry()
    a = reg.register(KernelSpec("g.b", B.TORCH, "m:a"))
    b = reg.register(KernelSpec("g.b", B.TRITON, "m:b"))
    c = reg.register(KernelSpec("g.a", B.TORCH, "m:c"))
    assert reg.get("g.b") == [a, b]
    assert reg.get("no.such") == []
    assert reg.has("g.a") and not reg.has("no.such")
    assert reg.ops() == ["g.a", "g.b"]
    assert reg.all_specs() == [c, a, b]


def test_get_returns_a_copy():
    reg = KernelRegistry()
    reg.register(KernelSpec("g.b", B.TORCH, "m:a"))
    reg.get("g.b").clear()
    assert len(reg.get("g.b")) == 1


def test_identical_registration_is_a_no_op():
    reg = KernelRegistry()
    reg.register(KernelSpec("g.b", B.TORCH, "m:a"))
    reg.register(KernelSpec("g.b", B.TORCH, "m:a"))
    assert len(reg.get("g.b")) == 1


def test_conflicting_registration_is_a_value_error():
    reg = KernelRegistry()
    reg.register(KernelSpec("g.b", B.TORCH, "m:a"))
    with pytest.raises(ValueError, match=r"Conflicting kernel registration for op 'g.b' backend 'torch'"):
        reg.register(KernelSpec("g.b", B.TORCH, "m:other"))
    assert reg.get("g.b")[0].target == "m:a"  # the first registration is kept


def test_get_backend_missing_is_a_key_error():
    reg = KernelRegistry()
    reg.register(KernelSpec("g.b", B.TORCH, "m:a"))
    with pytest.raises(KeyError, match="No 'triton' backend registered for op 'g.b'"):
        reg.get_backend("g.b", B.TRITON)


def test_op_definition_conflicts_are_rejected_and_identical_ones_accepted():
    reg = KernelRegistry()
    make = lambda shape, device: ()  # noqa: E731
    reg.define(OpDefinition("g.b", shapes=({"n": 1},), make_inputs=make))
    reg.define(OpDefinition("g.b", shapes=({"n": 1},), make_inputs=make))
    with pytest.raises(ValueError, match="Conflicting op definition for 'g.b'"):
        reg.define(OpDefinition("g.b", shapes=({"n": 2},), make_inputs=make))


def test_register_op_parses_the_reference_backend(monkeypatch):
    import autosel.registry  # noqa: F401  (the module; the package attribute is the registry object)

    fresh = KernelRegistry()
    monkeypatch.setattr(sys.modules["autosel.registry"], "registry", fresh)
    definition = register_op("g.c", shapes=[{"n": 1}], make_inputs=lambda s, d: (), reference="triton")
    assert definition.reference is B.TRITON and fresh.definition("g.c") is definition


def test_third_party_package_registers_through_the_entry_point(tmp_path):
    """A tiny package with an `autosel.ops` entry point, installed with pip, gets its op registered."""
    src = tmp_path / "src"
    (src / "tinyops").mkdir(parents=True)
    (src / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "tinyops"
        version = "0.1"
        [project.entry-points."autosel.ops"]
        tiny = "tinyops:register"
    """))
    (src / "tinyops" / "__init__.py").write_text(textwrap.dedent("""
        from autosel import KernelSpec, register_kernel
        def register():
            register_kernel(KernelSpec("tiny.neg", "torch", "operator:neg"))
    """))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, capture_output=True)
    probe = "import autosel; print(autosel.get_kernel('tiny.neg')(3)); print('tinyops' in __import__('sys').modules)"
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["-3", "True"]


def _inputs(shape, device):
    return ()


@pytest.mark.parametrize("kwargs, error, message", [
    # rtol=nan used to be accepted and switch the correctness check off (a kernel returning 3x was chosen):
    ({"rtol": float("nan")}, ValueError, "rtol=nan for op 'g.nan' is not a finite non-negative tolerance"),
    ({"atol": float("inf")}, ValueError, "atol=inf for op 'g.nan' is not a finite non-negative tolerance"),
    ({"atol": -1e-3}, ValueError, "atol=-0.001 for op 'g.nan' is not a finite non-negative tolerance"),
    ({"rtol": "1e-2"}, TypeError, "rtol for op 'g.nan' must be a number or None"),
    # make_inputs=None used to fail only at tune time:
    ({"make_inputs": None}, TypeError, "make_inputs for op 'g.nan' must be a function"),
    ({"shapes": None}, TypeError, "shapes for op 'g.nan' must be a list of dicts"),
    ({"shapes": [64]}, TypeError, "each shape of op 'g.nan' must be a dict"),
    ({"reference": 3}, TypeError, "reference for op 'g.nan' must be a backend name"),
    ({"reference": "cuda"}, ValueError, "unknown kernel backend 'cuda'"),
])
def test_register_op_rejects_bad_values_when_called(monkeypatch, kwargs, error, message):
    fresh = KernelRegistry()
    monkeypatch.setattr(sys.modules["autosel.registry"], "registry", fresh)
    args = {"shapes": [{"n": 1}], "make_inputs": _inputs, **kwargs}
    with pytest.raises(error) as info:
        register_op("g.nan", **args)
    assert str(info.value).startswith(message)
    assert fresh.definition("g.nan") is None


def test_register_kernel_of_something_else_is_a_type_error():
    # register_kernel("x") used to raise AttributeError.
    from autosel.registry import register_kernel

    with pytest.raises(TypeError, match="register_kernel takes a KernelSpec, got 'x'"):
        register_kernel("x")
