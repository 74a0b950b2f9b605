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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILTIN_OPS = ["activation.gelu_and_mul", "activation.silu_and_mul", "embeddings.rope", "gemm.mm",
               "layernorm.fused_add_rmsnorm", "layernorm.rmsnorm"]


def _python(code: str, tmp_path, extra_path: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (extra_path, ROOT) if p),
               AUTOSEL_DB=str(tmp_path / "user.db"))
    script = tmp_path / "probe.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, cwd=tmp_path)


def _readme_block(heading: str) -> str:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text[text.index(heading):]
    return section[section.index("```python") + len("```python"):].split("```", 1)[0]


def test_readme_engine_snippet_runs_as_pasted_and_keeps_the_builtin_ops(tmp_path):
    # The snippet registered a torch rmsnorm under layernorm.rmsnorm: the built-in plug-in then failed as a
    # whole and get_kernel("activation.silu_and_mul") raised KeyError; it also used an undefined input factory.
    check = textwrap.dedent("""
        assert y.shape == (8, 4096) and out.shape == (8, 1024), (y.shape, out.shape)
        assert autosel.registry.ops() == %r, autosel.registry.ops()
        print("ok")
    """) % (sorted(BUILTIN_OPS + ["myengine.rmsnorm"]),)
    result = _python(_readme_block("## Using it from an engine") + check, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]


def test_registry_reads_see_the_plugins_before_any_selection_and_import_no_torch(tmp_path):
    # The registry was empty (ops() == [], has("gemm.mm") False) until the first select_kernel loaded the plug-ins.
    code = textwrap.dedent("""
        import sys, autosel
        print(autosel.registry.ops() == %r, autosel.registry.has("gemm.mm"),
              autosel.registry.definition("gemm.mm") is not None, "torch" in sys.modules, "triton" in sys.modules)
    """) % (BUILTIN_OPS,)
    result = _python(code, tmp_path)
    assert result.stdout.split() == ["True", "True", "True", "False", "False"], result.stderr


def test_user_registration_conflicting_with_a_builtin_fails_at_the_users_call(tmp_path):
    # A conflicting user spec registered first made the built-in plug-in fail, unregistering every built-in op.
    code = textwrap.dedent("""
        import autosel, importlib
        from autosel import KernelSpec
        try:
            autosel.register_kernel(KernelSpec("layernorm.rmsnorm", "torch", "myengine.norm:rmsnorm_torch"))
        except ValueError as exc:
            print(exc)
        print(len(autosel.registry.ops()), importlib.import_module("autosel.registry").plugin_errors)
    """)
    result = _python(code, tmp_path)
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Conflicting kernel registration for op 'layernorm.rmsnorm' backend 'torch': already "
                               "registered with target 'autosel.ops.torch_impl:rmsnorm', now "
                               "'myengine.norm:rmsnorm_torch'"), result.stderr
    assert lines[1] == "6 {}"


def test_a_plugin_whose_one_spec_conflicts_keeps_its_other_specs(tmp_path):
    # One conflicting registration inside an entry point's hook used to abort the hook and lose its other specs.
    site = tmp_path / "site"
    info = site / "clashing-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: clashing\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[autosel.ops]\nclashing = clashing:register\n")
    (site / "clashing.py").write_text(textwrap.dedent("""
        from autosel import KernelSpec, register_kernel
        def register():
            register_kernel(KernelSpec("layernorm.rmsnorm", "torch", "clashing:rmsnorm"))
            register_kernel(KernelSpec("clashing.neg", "torch", "operator:neg"))
    """))
    code = textwrap.dedent("""
        import autosel, importlib
        errors = importlib.import_module("autosel.registry").plugin_errors
        print(autosel.registry.ops())
        print(sorted(errors))
        print(autosel.registry.get("layernorm.rmsnorm")[0].target in ("autosel.ops.torch_impl:rmsnorm",
                                                                      "clashing:rmsnorm"))
        print(list(errors.values())[0])
    """)
    result = _python(code, tmp_path, extra_path=str(site))
    lines = result.stdout.splitlines()
    assert lines[0] == repr(sorted(BUILTIN_OPS + ["clashing.neg"])), result.stderr
    assert lines[1] in ("['builtin']", "['clashing']")  # whichever entry point ran second met the conflict
    assert lines[2] == "True"
    assert "Conflicting kernel registration for op 'layernorm.rmsnorm' backend 'torch'" in lines[3]


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


def test_a_conflicting_registration_with_the_same_target_names_the_fields_that_differ():
    # It said "already registered with target 'm:f', now 'm:f'": the same text twice, the difference unsaid.
    reg = KernelRegistry()
    reg.register(KernelSpec("g.b", B.TORCH, "m:f", requires=("torch",), description="pure torch"))
    with pytest.raises(ValueError, match=r"already registered with requires \('torch',\), now \(\); description "
                                         r"'pure torch', now ''; register each"):
        reg.register(KernelSpec("g.b", B.TORCH, "m:f"))
