"""sglang's own tests of the selector autosel replaces (sgl-project/sglang,
test/registered/unit/kernels/test_kernels_namespace.py), ported to autosel's API: the same contract, with the one
documented change (several eligible backends give the measured winner, and the multiple-backends ValueError where
nothing can be timed), plus what that package exports for kernel metadata. Its tests of sglang's own op inventory
(kimi_k3, lora, its architecture tables) and of BaseFusedOp are out of scope (README, "Parity with sglang's
kernels package")."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import autosel as K
from autosel.platforms import PlatformInfo
from autosel.spec import CapabilityRequirement as Cap, FormatSignature, KernelBackend, KernelSpec, OpDefinition
from conftest import fresh_registry, use_platform

HERE = Path(__file__).resolve().parent
_CPU = PlatformInfo(device_type="cpu")
_SM90 = PlatformInfo(device_type="cuda", cuda_arch_major=9, cuda_arch_minor=0)
_SM100 = PlatformInfo(device_type="cuda", cuda_arch_major=10, cuda_arch_minor=0)
_HIP = PlatformInfo(device_type="hip")


@pytest.fixture
def reg(monkeypatch):
    return fresh_registry(monkeypatch, _SM90)


def fp8_scaled_mm(reg) -> None:
    """Upstream's gemm.fp8_scaled_mm: AOT on CUDA, torch._scaled_mm (TORCH) on SM90 only."""
    reg.register(KernelSpec("gemm.fp8_scaled_mm", KernelBackend.AOT, "toy_kernels:fast", capabilities={Cap.CUDA}))
    reg.register(KernelSpec("gemm.fp8_scaled_mm", KernelBackend.TORCH, "toy_kernels:slow",
                            capabilities={Cap.cuda(min_sm=(9, 0), max_sm=(9, 0))}))


def test_single_backend_resolves_without_backend(reg, monkeypatch):
    reg.register(KernelSpec("kvcache.reshape_and_cache_flash", KernelBackend.TRITON, "toy_kernels:fast",
                            capabilities={Cap.CUDA, Cap.HIP}))
    use_platform(monkeypatch, _CPU)  # one spec: returned with no device check
    assert K.select_kernel("kvcache.reshape_and_cache_flash").backend is KernelBackend.TRITON


def test_fp8_scaled_mm_requires_explicit_registry_backend_where_nothing_can_be_timed(reg, monkeypatch):
    # The documented change: upstream raises here always; autosel raises where it cannot measure (tuning off, as
    # here, or no representative shapes) and otherwise returns the measured winner (next test).
    fp8_scaled_mm(reg)
    monkeypatch.setenv("AUTOSEL_TUNE", "off")
    with pytest.raises(ValueError, match="multiple backends"):
        K.select_kernel("gemm.fp8_scaled_mm")
    assert K.select_kernel("gemm.fp8_scaled_mm", backend=KernelBackend.AOT).backend is KernelBackend.AOT


def test_several_eligible_backends_give_the_measured_winner(reg, monkeypatch):
    import toy_kernels

    use_platform(monkeypatch, _CPU)
    reg.register(KernelSpec("toy.double", KernelBackend.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.double", KernelBackend.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.double", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs))
    assert K.select_kernel("toy.double").backend is KernelBackend.TRITON  # 64x less work, measured


def test_unknown_op_or_backend_raises(reg):
    fp8_scaled_mm(reg)
    with pytest.raises(KeyError, match="No kernels registered for op 'does_not.exist'"):
        K.select_kernel("does_not.exist")
    with pytest.raises(KeyError, match="No 'triton' backend registered for op 'gemm.fp8_scaled_mm'"):
        K.select_kernel("gemm.fp8_scaled_mm", backend=KernelBackend.TRITON)


@pytest.mark.parametrize("platform, eligible", [
    (_SM90, True), (_SM100, True), (PlatformInfo(device_type="cuda", cuda_arch_major=8, cuda_arch_minor=0), False),
    (_CPU, False), (_HIP, False),
])
def test_qwen_qkv_registry_accepts_hopper(reg, platform, eligible):
    reg.register(KernelSpec("diffusion.qwen_qkv_epilogue", KernelBackend.JIT, "toy_kernels:fast",
                            capabilities={Cap.cuda(min_sm=(9, 0))}))
    spec = K.select_kernel("diffusion.qwen_qkv_epilogue")
    assert spec.backend is KernelBackend.JIT
    assert K.capabilities_satisfied(spec.capabilities, platform) is eligible


def test_multi_backend_requires_explicit_backend_and_names_its_target(reg, monkeypatch):
    reg.register(KernelSpec("layernorm.rmsnorm", KernelBackend.AOT, "toy_kernels:fast", capabilities={Cap.CUDA}))
    reg.register(KernelSpec("layernorm.rmsnorm", KernelBackend.JIT, "toy_kernels:slow", capabilities={Cap.CUDA}))
    monkeypatch.setenv("AUTOSEL_TUNE", "off")
    with pytest.raises(ValueError):
        K.select_kernel("layernorm.rmsnorm")
    spec = K.select_kernel("layernorm.rmsnorm", backend=KernelBackend.JIT)
    assert spec.backend is KernelBackend.JIT and spec.target == "toy_kernels:slow"


@pytest.mark.parametrize("req, plat, ok", [
    (Cap.CUDA, _CPU, False), (Cap.CUDA, _SM90, True), (Cap.CUDA, _HIP, False), (Cap.HIP, _HIP, True),
    (Cap.cuda(min_sm=(10, 0)), _SM90, False), (Cap.cuda(min_sm=(10, 0)), _SM100, True),
    (Cap.cuda(max_sm=(9, 0)), _SM100, False),
])
def test_capability_is_satisfied_by(req, plat, ok):
    assert req.is_satisfied_by(plat) is ok


def test_capabilities_or_semantics():
    both = {Cap.CUDA, Cap.HIP}
    assert K.capabilities_satisfied(both, _SM90)
    assert K.capabilities_satisfied(both, _HIP)
    assert not K.capabilities_satisfied(both, _CPU)
    assert K.capabilities_satisfied((), _CPU)  # empty = unrestricted
    assert K.capabilities_satisfied(Cap.CUDA, _SM90)  # single tolerated


@pytest.mark.parametrize("sm, expected", [
    ((8, 0), False), ((9, 0), True), ((10, 0), True), ((10, 1), False), ((10, 3), True), ((12, 0), False),
])
def test_registered_architecture_boundaries(sm, expected):
    # Upstream's attention.deep_select_topk: an exact-SM set, one cuda(min_sm=x, max_sm=x) per architecture.
    spec = KernelSpec("attention.deep_select_topk", KernelBackend.JIT, "toy_kernels:fast",
                      capabilities=frozenset(Cap.cuda(min_sm=x, max_sm=x) for x in ((9, 0), (10, 0), (10, 3))))
    platform = PlatformInfo(device_type="cuda", cuda_arch_major=sm[0], cuda_arch_minor=sm[1])
    assert K.capabilities_satisfied(spec.capabilities, platform) is expected
    assert spec.is_available(platform) is expected
    assert not K.capabilities_satisfied(spec.capabilities, _CPU)


def test_import_stays_metadata_only():
    # Importing the namespace and its ops must not import a backend, nor torch (upstream: no sgl_kernel, no JIT).
    code = ("import sys, autosel, autosel.ops; autosel.registry.ops(); "
            "print('DIRTY' if any(m in sys.modules for m in ('torch', 'triton', 'sgl_kernel', 'flashinfer', "
            "'deep_gemm', 'aiter', 'cutlass', 'flydsl')) else 'CLEAN')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(HERE.parent), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert "CLEAN" in result.stdout


def test_inventory_targets_survive_module_moves():
    """Moving a module without its lazy target otherwise breaks only on first call."""
    K.registry.ops()  # loads the built-in ops
    for spec in K.registry.all_specs():
        module, _ = spec.target.split(":", 1)
        if module.startswith("autosel."):
            assert importlib.util.find_spec(module) is not None, spec


# Upstream's newest KernelBackend values (sglang.kernels.spec), KDA's upper case included.
UPSTREAM_BACKENDS = ("torch", "torch_compile", "triton", "jit", "aot", "cute_dsl", "flydsl", "KDA", "flashinfer",
                     "deepgemm", "aiter", "torch_npu", "mlx", "sgl_kernel_npu")


@pytest.mark.parametrize("value", UPSTREAM_BACKENDS)
def test_every_upstream_backend_name_is_a_backend(value):
    assert KernelBackend(value).value == value


def test_an_engine_brings_a_backend_name_autosel_does_not_list(reg, monkeypatch):
    # Upstream's enum grows faster than autosel's list: a spec naming another provenance was a ValueError, to be
    # fixed only by editing autosel.
    name = "engine_dsl"
    with pytest.raises(ValueError, match=r"KernelBackend.declare\('engine_dsl'\)"):
        KernelSpec("toy.double", name, "toy_kernels:fast")
    backend = KernelBackend.declare(name)
    assert KernelBackend.declare(name) is backend and KernelBackend(name) is backend
    assert KernelBackend.declare("sgl-kernel") is KernelBackend.SGL_KERNEL  # a spelling of a listed one is that one
    reg.register(KernelSpec("toy.double", name, "toy_kernels:fast"))
    reg.register(KernelSpec("toy.double", KernelBackend.TORCH, "toy_kernels:slow", capabilities={Cap.HIP}))
    assert K.select_kernel("toy.double").backend is backend  # the one eligible on SM90
    assert K.select_kernel("toy.double", backend=name).target == "toy_kernels:fast"
    with pytest.raises(ValueError, match="letters, digits"):
        KernelBackend.declare("not a name")


def test_a_spec_carries_a_format_signature_as_documentation():
    signature = FormatSignature(supported_dtypes=("bfloat16", "float16"), in_place=True, description="y += x")
    spec = KernelSpec("layernorm.fused_add_rmsnorm", KernelBackend.TORCH, "toy_kernels:slow",
                      format_signature=signature)
    assert spec.format_signature.supported_dtypes == ("bfloat16", "float16") and spec.format_signature.in_place
    assert KernelSpec("a.b", "torch", "m:f").format_signature == FormatSignature()
    with pytest.raises(TypeError, match="format_signature must be a FormatSignature"):
        KernelSpec("a.b", "torch", "m:f", format_signature={"in_place": True})
    with pytest.raises(TypeError, match="supported_dtypes must be dtype names"):
        FormatSignature(supported_dtypes=(1,))
