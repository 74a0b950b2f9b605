"""KernelRegistry: registration order, idempotent identical registration, conflicts, copies, op definitions."""

from __future__ import annotations

import json
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
BUILTIN_OPS = ["activation.gelu_and_mul", "activation.silu_and_mul", "attention.decode", "attention.extend",
               "embeddings.rope", "gemm.mm",
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
    assert lines[1] == f"{len(BUILTIN_OPS)} {{}}"


def _plugin(tmp_path, name: str, body: str) -> str:
    """An installed package `name` whose `autosel.ops` entry point `name` runs `register()` from `body`; returns the
    folder to put first on PYTHONPATH, so importlib.metadata lists it before autosel's own entry point."""
    site = tmp_path / "site"
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[autosel.ops]\n{name} = {name}:register\n")
    (site / f"{name}.py").write_text(textwrap.dedent(body))
    return str(site)


def test_a_plugin_whose_one_spec_conflicts_keeps_its_other_specs_and_the_builtin_wins(tmp_path):
    # One conflicting registration inside an entry point's hook used to abort the hook and lose its other specs;
    # a plug-in listed before autosel's own entry point then replaced the built-in and 'builtin' was blamed.
    site = _plugin(tmp_path, "clashing", """
        from autosel import KernelSpec, register_kernel
        def register():
            register_kernel(KernelSpec("layernorm.rmsnorm", "torch", "clashing:rmsnorm"))
            register_kernel(KernelSpec("clashing.neg", "torch", "operator:neg"))
    """)
    code = textwrap.dedent("""
        import autosel, importlib.metadata
        errors = importlib.import_module("autosel.registry").plugin_conflicts
        print([e.name for e in importlib.metadata.entry_points(group="autosel.ops")])
        print(autosel.registry.ops())
        print(sorted(errors))
        print(autosel.registry.get_backend("layernorm.rmsnorm", "torch").target)
        print(list(errors.values())[0])
    """)
    result = _python(code, tmp_path, extra_path=site)
    lines = result.stdout.splitlines()
    assert lines[0] == "['clashing', 'builtin']", result.stderr  # the order this test is about
    assert lines[1] == repr(sorted(BUILTIN_OPS + ["clashing.neg"]))
    assert lines[2] == "['clashing']"
    assert lines[3] == "autosel.ops.torch_impl:rmsnorm"
    assert lines[4].startswith("ValueError: Conflicting kernel registration for op 'layernorm.rmsnorm' backend "
                               "'torch': already registered with target 'autosel.ops.torch_impl:rmsnorm', now "
                               "'clashing:rmsnorm'")


def test_doctor_names_the_plugin_that_conflicts_with_a_builtin(tmp_path):
    # `autosel doctor` said "Plug-in 'builtin' failed to load" when the offending plug-in was listed first.
    site = _plugin(tmp_path, "badplug", """
        from autosel import KernelSpec, register_kernel
        def register():
            register_kernel(KernelSpec("layernorm.rmsnorm", "torch", "badplug:k"))
    """)
    code = "import sys; from autosel.cli import main; sys.argv = ['autosel', 'doctor', '--json']; main()"
    result = _python(code, tmp_path, extra_path=site)
    report = json.loads(result.stdout)
    assert list(report["plugin_conflicts"]) == ["badplug"], result.stderr
    assert "now 'badplug:k'" in report["plugin_conflicts"]["badplug"]
    # It said the plug-in "failed to load" and exited 1, "selection is blocked", though selection worked.
    assert report["ok"] and report["plugin_errors"] == {} and result.returncode == 0


def test_a_plugin_whose_hook_raises_leaves_nothing_registered(tmp_path):
    # Its log said "its ops are not registered" while the spec and op definition it made before raising stayed.
    site = _plugin(tmp_path, "halfway", """
        from autosel import KernelSpec, register_kernel, register_op
        from autosel.ops import layernorm
        def _inputs(shape, device):
            return ()
        def register():
            register_kernel(KernelSpec("halfway.neg", "torch", "operator:neg"))
            register_kernel(layernorm.SPECS[0])  # the built-in's own spec: a no-op, not undone with the rest
            register_op("halfway.neg", shapes=[{"n": 1}], make_inputs=_inputs)
            raise RuntimeError("no GPU library")
    """)
    code = textwrap.dedent("""
        import autosel, importlib
        print(autosel.registry.ops() == %r, autosel.registry.definition("halfway.neg"))
        print(importlib.import_module("autosel.registry").plugin_errors)
    """) % (BUILTIN_OPS,)
    result = _python(code, tmp_path, extra_path=site)
    lines = result.stdout.splitlines()
    assert lines == ["True None", "{'halfway': 'RuntimeError: no GPU library'}"], result.stderr
    assert "the 2 registrations it made before failing are undone" in result.stderr


def _inputs(shape, device):
    return ()


@pytest.mark.parametrize("kwargs, error, message", [
    # rtol=nan used to be accepted and switch the correctness check off (a kernel returning 3x was chosen):
    ({"rtol": float("nan")}, ValueError, "rtol=nan for op 'g.nan' is not a finite non-negative tolerance"),
    ({"atol": float("inf")}, ValueError, "atol=inf for op 'g.nan' is not a finite non-negative tolerance"),
    ({"atol": -1e-3}, ValueError, "atol=-0.001 for op 'g.nan' is not a finite non-negative tolerance"),
    # rtol=1e308 was accepted, and a kernel wrong everywhere then won: tolerances that no output can exceed.
    ({"rtol": 1e308}, ValueError, "rtol=1e+308 for op 'g.nan' lets an output be off by 1e+308 times the reference's "
                                  "size, so all zeros (or a wrong sign, from rtol=2) pass: a check that cannot fail"),
    ({"rtol": 1}, ValueError, "rtol=1 for op 'g.nan' lets an output be off by 1 times"),
    ({"atol": 1e308}, ValueError, "atol=1e+308 for op 'g.nan' is over twice the largest float32 (3.40282e+38), so "
                                  "every finite float32, float16 or bfloat16 output passes"),
    ({"rtol": "1e-2"}, TypeError, "rtol for op 'g.nan' must be a number or None"),
    # make_inputs=None used to fail only at tune time:
    ({"make_inputs": None}, TypeError, "make_inputs for op 'g.nan' must be a function"),
    ({"shapes": None}, TypeError, "shapes for op 'g.nan' must be a list of dicts"),
    ({"shapes": [64]}, TypeError, "shape 0 of op 'g.nan' must be a dict"),
    ({"reference": 3}, TypeError, "reference for op 'g.nan' must be a backend name"),
    ({"reference": "cuda"}, ValueError, "unknown kernel backend 'cuda'"),
    # A kernel target's form was read as a backend name ("unknown kernel backend 'mypkg.ref:rmsnorm'"):
    ({"reference": "mypkg.ref:rmsnorm"}, ValueError, "reference for op 'g.nan' is 'mypkg.ref:rmsnorm': pass the "
                                                     "function itself"),
    # Empty shapes failed only when a tune came to time the op:
    ({"shapes": []}, ValueError, "shapes for op 'g.nan' is empty: give at least one representative shape"),
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


def _register_twice(make_inputs_1, make_inputs_2, shapes_2=({"n": 1},)):
    reg = KernelRegistry()
    reg.define(OpDefinition("r.l", shapes=({"n": 1},), make_inputs=make_inputs_1))
    with pytest.raises(ValueError) as info:
        reg.define(OpDefinition("r.l", shapes=shapes_2, make_inputs=make_inputs_2))
    return str(info.value)


def _closure():
    return lambda shape, device: ()


def test_a_repeated_op_definition_with_a_lambda_made_again_says_to_use_a_module_level_function():
    # It said only "register_op was already called for it": a lambda made again is unequal to the first one.
    assert _register_twice(_closure(), _closure()) == (
        "Conflicting op definition for 'r.l': register_op was already called for it with make_inputs the same "
        f"code as a new function object ({__name__}:_closure.<locals>.<lambda>), equal only to itself; "
        "define make_inputs as a module-level function rather than a lambda or closure, so that calling "
        "register_op again passes the same object and is a no-op")


def test_a_conflicting_op_definition_names_the_fields_that_differ():
    # It named no field, so the two definitions had to be compared by hand.
    other = lambda shape, device: ()  # noqa: E731
    message = _register_twice(_inputs, other, shapes_2=({"n": 2},))
    assert message == (
        "Conflicting op definition for 'r.l': register_op was already called for it with shapes ({'n': 1},), "
        f"now ({{'n': 2}},); make_inputs {__name__}:_inputs, now "
        f"{__name__}:test_a_conflicting_op_definition_names_the_fields_that_differ.<locals>.<lambda>; "
        "define each op once, or use an op name of your own (e.g. 'myengine.rmsnorm')")


def test_one_shape_given_bare_says_to_wrap_it_in_a_list():
    # Iterating the dict blamed its first key: "each shape ... must be a dict such as {'tokens': 64}, got 'n'".
    with pytest.raises(TypeError, match=r"^shapes for op 'my\.e2' must be a list of dicts, got one dict \{'n': 1\}: "
                                        r"pass \[\{'n': 1\}\]$"):
        register_op("my.e2", shapes={"n": 1}, make_inputs=lambda shape, device: ())
