"""Platform detection and keys: detect() never raises, keys separate SKUs, version vectors are per op."""

from __future__ import annotations

import sys

import pytest

from autosel.platforms import PlatformInfo, modes_for_device, normalise_device_name, version_vector
from autosel.spec import KernelBackend as B, KernelSpec


def test_detect_on_this_machine_is_a_cpu_with_versions():
    platform = PlatformInfo.detect()
    assert platform.device_type in ("cpu", "cuda", "hip", "mps")
    assert "torch" in platform.version_map
    assert platform.multiprocessor_count > 0


def test_detect_never_raises(monkeypatch):
    import autosel.platforms as platforms

    def broken():
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(platforms, "_detect", broken)
    assert PlatformInfo.detect().device_type == "cpu"


@pytest.mark.parametrize("name, normal", [
    ("NVIDIA H200", "NVIDIA_H200"), ("NVIDIA H20-3e", "NVIDIA_H20-3e"), ("  ", "unknown"),
    ("AMD Instinct MI300X", "AMD_Instinct_MI300X"),
])
def test_device_names_are_normalised(name, normal):
    assert normalise_device_name(name) == normal


def test_platform_key_has_type_arch_name_and_sm_count():
    h200 = PlatformInfo("cuda", 9, 0, arch="sm_90", device_name="NVIDIA H200", multiprocessor_count=132)
    h100 = PlatformInfo("cuda", 9, 0, arch="sm_90", device_name="NVIDIA H100 80GB HBM3", multiprocessor_count=132)
    assert h200.key == "cuda/sm_90/NVIDIA_H200/132"
    assert h200.key != h100.key  # one arch spans several SKUs


@pytest.mark.parametrize("device_type, modes", [
    ("cuda", ("eager", "graph")), ("hip", ("eager", "graph")),
    ("cpu", ("eager",)), ("mps", ("eager",)), ("xpu", ("eager",)), ("npu", ("eager",)), ("tpu", ("eager",)),
    ("", ("eager",)),
])
def test_devices_with_cuda_graphs_have_a_graph_mode_and_others_eager_only(device_type, modes):
    assert modes_for_device(device_type) == modes


MI300X = PlatformInfo("hip", arch="gfx942", device_name="AMD Instinct MI300X", multiprocessor_count=304)


@pytest.mark.parametrize("platform", [
    MI300X, PlatformInfo("cuda", 9, 0, arch="sm_90", device_name="NVIDIA H200", multiprocessor_count=132),
    PlatformInfo("cpu", arch="x86_64"), PlatformInfo("mps", arch="apple"), PlatformInfo("tpu", arch="v5"),
], ids=lambda p: p.device_type)
def test_tuning_coverage_and_selection_agree_on_a_platforms_modes(platform):
    # Each decided graph mode on its own; they agreed only because HIP's torch device is "cuda".
    from autosel import coverage, selector, tuning

    expected = list(modes_for_device(platform.device.value))
    selected = [mode for mode in ("eager", "graph") if selector.resolve_mode(mode, platform) == mode]
    assert tuning.modes_for(platform) == coverage.modes_of(platform.key) == selected == expected


def test_version_vector_holds_base_versions_and_candidate_packages_only():
    platform = PlatformInfo("cpu", versions=(("torch", "2.13.0"), ("flashinfer-python", "0.7"), ("cuda", "13.0")))
    specs = [KernelSpec("a.b", B.TORCH, "autosel.ops.torch_impl:rmsnorm", requires=("torch",)),
             KernelSpec("a.b", B.JIT, "json:dumps", requires=("json",))]
    versions = version_vector(platform, specs)
    assert versions["cuda"] == "13.0" and "flashinfer-python" not in versions  # not a candidate's package
    assert versions["torch"]  # from installed metadata
    assert "autosel" in versions  # own kernels change with autosel releases


@pytest.mark.parametrize("device, eligible, has_triton", [
    ("cpu", [B.TORCH, B.TORCH_COMPILE], False),
    ("cpu", [B.TORCH, B.TRITON], True),
    ("cuda", [B.TORCH, B.TORCH_COMPILE], True),
])
def test_triton_is_in_the_version_vector_only_where_it_can_change_the_decision(device, eligible, has_triton):
    # Installing triton on a CPU host (the Quick start's step 2) turned every CPU decision stale:
    # "versions differ: triton (none) -> 3.9.0", although no triton backend was eligible there.
    platform = PlatformInfo(device, versions=(("torch", "2.13.0"), ("triton", "3.9.0")))
    requires = {B.TRITON: ("torch", "triton")}
    specs = [KernelSpec("a.b", b, f"autosel.ops.torch_impl:{b.value}", requires=requires.get(b, ("torch",)))
             for b in eligible]
    assert ("triton" in version_vector(platform, specs)) is has_triton


def _package(root, name):
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("VALUE = 1\n")
    return root / name


def test_missing_bytecode_names_a_package_every_process_compiles_again(tmp_path, monkeypatch):
    # The H200 image set PYTHONDONTWRITEBYTECODE and shipped torch without bytecode: every process compiled it.
    import py_compile

    from autosel.platforms import missing_bytecode

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    package = _package(tmp_path, "autosel_fake_pkg")
    assert missing_bytecode(("autosel_fake_pkg", "autosel_not_installed"), dont_write=True) == ["autosel_fake_pkg"]
    assert missing_bytecode(("autosel_fake_pkg",), dont_write=False) == []  # the first import writes it
    py_compile.compile(str(package / "__init__.py"))
    assert missing_bytecode(("autosel_fake_pkg",), dont_write=True) == []


def test_missing_bytecode_looks_under_the_pycache_prefix(tmp_path, monkeypatch):
    from autosel.platforms import missing_bytecode

    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    (tmp_path / "site").mkdir()
    _package(tmp_path / "site", "autosel_fake_pkg2")
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "prefix"))  # not there yet: writable parent
    assert missing_bytecode(("autosel_fake_pkg2",), dont_write=False) == []
    assert missing_bytecode(("autosel_fake_pkg2",), dont_write=True) == ["autosel_fake_pkg2"]
