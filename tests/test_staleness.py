"""autosel.staleness: a decision's fingerprint changes with what it was measured on and with nothing else, a changed
one makes the decision stale wherever the stale rule is asked, and reading a stored decision imports nothing heavy."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from autosel import selector, staleness, tuning
from autosel.decisions import CandidateResult, Decision, ShapeResult
from autosel.inventory import Inventory
from autosel.platforms import PlatformInfo
from autosel.registry import KernelRegistry
from autosel.spec import KernelBackend as B, KernelSpec, OpDefinition
from conftest import use_platform, use_registry

KERNELS = '''
def _scale(x):
    return x * 2


def fast(x):
    """The challenger."""
    return _scale(x)


def slow(x):
    return [v * 2 for v in x]


def unrelated(x):
    return x
'''
OPS = '''
SHAPES = [{"n": 16}, {"n": 1024}]


def inputs(shape, device):
    return (shape["n"],)


def bucket(n):
    return (n,)
'''
OTHER = '''
def helper():
    return 1
'''
EDITS = {  # what changes, and how: (file, old, new)
    "kernel body": ("kernels.py", "return _scale(x)", "return _scale(x) + 0"),
    "helper the kernel calls": ("kernels.py", "return x * 2\n", "return x * 2 + 0\n"),
    "bucket function": ("ops.py", "return (n,)", "return (n // 2,)"),
    "unrelated function in the kernel's module": ("kernels.py", "def unrelated(x):\n    return x",
                                                  "def unrelated(x):\n    return -x"),
    "another module of the package": ("other.py", "return 1", "return 2"),
    "comments and blank lines": ("kernels.py", "def fast(x):", "# why fast is fast\n\n\ndef fast(x):"),
}
STALE = {"kernel body": ["the jit kernel's code"], "helper the kernel calls": ["the jit kernel's code"],
         "bucket function": ["the op's bucket function"]}
CPU = PlatformInfo(device_type="cpu", arch="x86_64", device_name="Test_CPU", multiprocessor_count=2)


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh package of kernels and op functions on sys.path: (its folder, its name)."""
    name = f"fp_{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "src" / name
    folder.mkdir(parents=True)
    for file, text in (("__init__.py", ""), ("kernels.py", KERNELS), ("ops.py", OPS), ("other.py", OTHER)):
        (folder / file).write_text(textwrap.dedent(text), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    staleness.clear()
    yield folder, name
    staleness.clear()
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def specs_of(name: str) -> list[KernelSpec]:
    return [KernelSpec("fp.op", B.TORCH, f"{name}.kernels:slow"), KernelSpec("fp.op", B.JIT, f"{name}.kernels:fast")]


def definition_of(name: str, **changes) -> OpDefinition:
    ops = importlib.import_module(f"{name}.ops")
    return OpDefinition("fp.op", **{"shapes": ops.SHAPES, "make_inputs": ops.inputs, "bucket": ops.bucket, **changes})


def edit(folder: Path, name: str, file: str, old: str, new: str) -> None:
    path = folder / file
    text = path.read_text(encoding="utf-8")
    assert old in text
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    importlib.reload(importlib.import_module(f"{name}.{file[:-3]}"))  # what a restarted process imports
    staleness.clear()


def test_a_fingerprint_names_the_op_and_each_candidate_whose_code_autosel_reads(package):
    _, name = package
    parts = staleness.fingerprint(definition_of(name), specs_of(name), CPU)
    assert sorted(parts) == ["bucket", "check", "kernel:jit", "kernel:torch", "shapes"]
    assert parts["kernel:jit"] != parts["kernel:torch"]
    vendor = KernelSpec("fp.op", B.FLASHINFER, "flashinfer.norm:rmsnorm", requires=("torch", "flashinfer"))
    assert staleness.kernel_identity(vendor) is None  # a vendor's function: its package version is in the key


@pytest.mark.parametrize("what", sorted(EDITS))
def test_an_edit_makes_the_decision_stale_only_where_it_changes_what_was_measured(package, what):
    folder, name = package
    before = staleness.fingerprint(definition_of(name), specs_of(name), CPU)
    edit(folder, name, *EDITS[what])
    after = staleness.fingerprint(definition_of(name), specs_of(name), CPU)
    assert staleness.changed_parts(before, after) == STALE.get(what, [])


@pytest.mark.parametrize("change, said", [
    ({"shapes": [{"n": 16}, {"n": 2048}]}, "the op's representative shapes"),
    ({"rtol": 0.5}, "the op's tolerances or reference"),
    ({"bucket": None}, "the op's bucket function"),
])
def test_a_changed_definition_makes_the_decision_stale(package, change, said):
    _, name = package
    before = staleness.fingerprint(definition_of(name), specs_of(name), CPU)
    after = staleness.fingerprint(definition_of(name, **change), specs_of(name), CPU)
    assert staleness.changed_parts(before, after) == [said]


def test_another_process_another_folder_and_another_machine_of_the_type_give_the_same_fingerprint(package, tmp_path):
    folder, name = package
    here = staleness.fingerprint(definition_of(name), specs_of(name), CPU)
    twin = dataclasses.replace(CPU, device_name="Other_CPU", multiprocessor_count=64)
    assert staleness.fingerprint(definition_of(name), specs_of(name), twin) == here
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(folder, elsewhere / name)  # the same code installed in another place, read by a fresh process
    code = (f"import json; from autosel import staleness; from autosel.platforms import PlatformInfo; "
            f"from test_staleness import CPU, definition_of, specs_of; "
            f"print(json.dumps(staleness.fingerprint(definition_of({name!r}), specs_of({name!r}), CPU)))")
    env_path = [str(elsewhere), str(Path(__file__).parent), str(Path(__file__).parents[1])]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": ":".join(env_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == here


def stored(name: str, definition: OpDefinition, platform: PlatformInfo) -> tuple[Decision, list[Decision]]:
    """A decision of fp.op, as a tune of the package's current code would store it, and one bucket row."""
    from autosel.platforms import version_vector

    specs = specs_of(name)
    measured = (ShapeResult({"n": 16}),)
    decision = Decision(op="fp.op", mode="eager", bucket="*", winner="jit", platform_key=platform.key,
                        versions=version_vector(platform, specs), margin=0.05, method="planted",
                        candidates=tuple(CandidateResult(b, "ok", score=1.0, shapes=measured)
                                         for b in ("torch", "jit")),
                        checked_with=definition.checked_with,
                        fingerprint=staleness.fingerprint(definition, specs, platform))
    return decision, [dataclasses.replace(decision, bucket="[16]")]


def test_a_changed_kernel_is_retuned_kept_with_a_warning_shown_and_refused(package, monkeypatch, caplog):
    # A kernel edited in place within one package version (an engine's own kernels, a local build) kept its decision.
    folder, name = package
    registry = KernelRegistry()
    for spec in specs_of(name):
        registry.register(spec)
    registry.define(definition_of(name))
    use_registry(monkeypatch, registry)
    use_platform(monkeypatch, CPU)
    decision, buckets = stored(name, registry.definition("fp.op"), CPU)
    layer = tuning.database().record(decision, buckets)
    names = ["torch", "jit"]
    assert staleness.outdated(tuning.database(), decision, layer, names, registry.definition("fp.op"),
                              specs_of(name)) == ""
    edit(folder, name, *EDITS["kernel body"])
    reason = staleness.outdated(tuning.database(), decision, layer, names, registry.definition("fp.op"),
                                specs_of(name))
    assert reason == "was measured on other code or definitions than run now (the jit kernel's code changed since)"
    entries = Inventory(CPU, registry).entries([(d, layer) for d in (decision, *buckets)])
    assert entries[0].status == "stale" and reason in entries[0].detail  # what `autosel show` lists
    monkeypatch.setenv("AUTOSEL_TUNE", "off")
    caplog.set_level(logging.WARNING, logger="autosel")
    assert selector.select_kernel("fp.op").backend == B.JIT  # kept where nothing can be timed, and said once
    assert f"the stored decision (jit) {reason}; it is kept" in caplog.text


def test_reading_a_stored_plain_torch_decision_imports_nothing_heavy(tmp_path):
    # Reading a stored decision built meta tensors to re-derive its bucket keys and imported torch._dynamo (about
    # 1.5 s), and imported sqlite-utils, before the first kernel ran.
    pytest.importorskip("torch")
    from autosel.ops import gemm
    from autosel.platforms import current_platform, version_vector

    platform = current_platform()
    registry = KernelRegistry()
    for spec in gemm.SPECS:
        registry.register(spec)
    eligible = [s for s in gemm.SPECS if s.is_available(platform)]
    definition = gemm.DEFINITIONS[0]
    shapes = definition.shapes_for(platform)
    decision = Decision(op="gemm.mm", mode="eager", bucket="*", winner="torch", platform_key=platform.key,
                        versions=version_vector(platform, eligible), margin=0.05, method="planted",
                        candidates=tuple(CandidateResult(s.backend.value, "ok", score=1.0,
                                                         shapes=(ShapeResult(shapes[0]),)) for s in eligible),
                        checked_with=definition.checked_with,
                        fingerprint=staleness.fingerprint(definition, eligible, platform))
    db_path = tmp_path / "stored.db"
    from autosel.db import TuningDB

    with TuningDB.open(db_path, include_package=False) as db:
        db.record(decision, [dataclasses.replace(decision, bucket='[1, "4096x4096"]')])
    code = textwrap.dedent("""
        import json, sys
        import torch, autosel
        import autosel.db
        autosel.db.package_folder = lambda: None
        before = set(sys.modules)
        kernel = autosel.get_kernel("gemm.mm")
        from autosel.ops import torch_impl
        print(json.dumps([kernel is torch_impl.mm, sorted(set(sys.modules) - before)]))
    """)
    env = {"PYTHONPATH": str(Path(__file__).parents[1]), "PATH": "/usr/bin:/bin", "AUTOSEL_TUNE": "off",
           "AUTOSEL_DB": str(db_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    plain, imported = json.loads(out.stdout.splitlines()[-1])
    assert plain
    heavy = [m for m in imported if m.split(".")[0] in ("sympy", "triton", "sqlite_utils", "click")
             or m.startswith(("torch._dynamo", "torch._inductor", "torch.fx", "torch._refs"))]
    assert heavy == []


TRITON_KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def _double_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)


def double(x):
    _double_kernel[(triton.cdiv(x.numel(), 1024),)](x, x.numel(), BLOCK=1024)
    return x
'''


def test_a_triton_kernels_source_is_part_of_its_launchers_identity(package):
    # Read from the file, not imported: a host without a GPU judges a GPU row's triton kernel as well.
    folder, name = package
    (folder / "tkernels.py").write_text(TRITON_KERNELS, encoding="utf-8")
    spec = KernelSpec("fp.op", B.TRITON, f"{name}.tkernels:double", requires=("torch", "triton"))
    before = staleness.kernel_identity(spec)
    path = folder / "tkernels.py"
    path.write_text(path.read_text(encoding="utf-8").replace("* 2, mask", "* 3, mask"), encoding="utf-8")
    staleness.clear()
    assert before is not None and staleness.kernel_identity(spec) != before
    assert f"{name}.tkernels" not in sys.modules
