"""KernelSpec, CapabilityRequirement and OpDefinition: eligibility is a pure function of (spec, platform)."""

from __future__ import annotations

import math
import re

import pytest

from autosel.platforms import PlatformInfo
from autosel.spec import CapabilityRequirement as Cap, DeviceType, KernelBackend as B, KernelSpec, OpDefinition

CPU = PlatformInfo("cpu")
SM80 = PlatformInfo("cuda", 8, 0)
SM90 = PlatformInfo("cuda", 9, 0)
SM100 = PlatformInfo("cuda", 10, 0)
HIP = PlatformInfo("hip", arch="gfx942")


@pytest.mark.parametrize("cap, platform, reason", [
    (Cap.CUDA, CPU, "needs cuda, device is cpu"),
    (Cap.CUDA, SM90, None),
    (Cap.CUDA, HIP, "needs cuda, device is hip"),
    (Cap.HIP, HIP, None),
    (Cap.cuda(min_sm=(10, 0)), SM90, "needs sm_100 or newer, device is sm_90"),
    (Cap.cuda(min_sm=(10, 0)), SM100, None),
    (Cap.cuda(max_sm=(9, 0)), SM100, "needs sm_90 or older, device is sm_100"),
    (Cap.cuda(min_sm=(9, 0), max_sm=(9, 0)), SM90, None),
    (Cap.cuda(min_sm=(9, 0)), PlatformInfo("cuda"), None),  # unknown arch: bounds cannot be checked
])
def test_capability_reasons_name_both_sides(cap, platform, reason):
    assert cap.unmet_reason(platform) == reason
    assert cap.is_satisfied_by(platform) is (reason is None)


@pytest.mark.parametrize("caps, platform, ok", [
    (frozenset({Cap.CUDA, Cap.HIP}), SM90, True),
    (frozenset({Cap.CUDA, Cap.HIP}), HIP, True),
    (frozenset({Cap.CUDA, Cap.HIP}), CPU, False),
    (frozenset(), CPU, True),  # empty means anywhere
    (Cap.CUDA, SM90, True),    # a single requirement is accepted and wrapped
])
def test_capability_sets_are_an_or(caps, platform, ok):
    assert KernelSpec("a.b", B.TRITON, "m:f", capabilities=caps).is_available(platform) is ok


def test_shortcuts_equal_their_long_forms():
    assert Cap.CUDA == Cap(device=DeviceType.CUDA)
    assert Cap.cuda(min_sm=(10, 0)) == Cap(device=DeviceType.CUDA, min_cuda_arch=(10, 0))
    assert {Cap.CUDA, Cap.HIP} == {Cap.HIP, Cap.CUDA}


def test_unavailable_reason_lists_every_unmet_capability():
    spec = KernelSpec("a.b", B.TRITON, "m:f", capabilities={Cap.CUDA, Cap.HIP})
    assert spec.unavailable_reason(CPU) == "needs cuda, device is cpu; or needs hip, device is cpu"


def test_missing_package_reason_names_the_pip_package():
    # It named sgl-kernel, the old package (0.3.x), which does not run with current torch; sglang-kernel does.
    spec = KernelSpec("a.b", B.SGL_KERNEL, "sgl_kernel:rmsnorm", requires=("sgl_kernel",))
    assert spec.unavailable_reason(CPU) == "package 'sgl_kernel' is not installed (pip install sglang-kernel)"


def test_is_available_never_imports(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def guarded(name, *args, **kwargs):
        assert not name.startswith("json"), "is_available imported the package"
        return real_import(name, *args, **kwargs)

    spec = KernelSpec("a.b", B.TORCH, "json:dumps", requires=("json",))
    import sys

    monkeypatch.delitem(sys.modules, "json", raising=False)
    monkeypatch.setattr(builtins, "__import__", guarded)
    assert spec.is_available(CPU)


def test_load_follows_dotted_attributes():
    assert KernelSpec("a.b", B.TORCH, "math:sqrt").load() is math.sqrt
    assert KernelSpec("a.b", B.TORCH, "os:path.join").load().__name__ == "join"


@pytest.mark.parametrize("target", ["no-colon", "module:", ":attr"])
def test_malformed_target_is_a_value_error(target):
    with pytest.raises(ValueError, match=r"KernelSpec.target must be 'module:attr', got"):
        KernelSpec("a.b", B.TORCH, target)


def test_backend_strings_are_parsed_and_unknown_ones_rejected():
    assert KernelSpec("a.b", "flashinfer", "m:f").backend is B.FLASHINFER
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda_magic'"):
        KernelSpec("a.b", "cuda_magic", "m:f")


@pytest.mark.parametrize("written, backend", [
    ("sgl-kernel", B.SGL_KERNEL), ("torch.compile", B.TORCH_COMPILE), ("Triton", B.TRITON),
    ("DeepGEMM", B.DEEPGEMM), ("deep_gemm", B.DEEPGEMM), ("cute-dsl", B.CUTE_DSL),
])
def test_backend_spellings_people_write_are_accepted(written, backend):
    # "sgl-kernel" and "torch.compile", as the README's prose writes them, were rejected as unknown backends.
    assert B.parse(written) is backend


def test_a_misspelt_backend_names_the_close_match():
    # A near miss was answered with the whole list only, not with the name the user probably meant.
    with pytest.raises(ValueError, match=r"unknown kernel backend 'flashinfr' \(did you mean 'flashinfer'\?\); known"):
        B.parse("flashinfr")


def test_group_and_name():
    spec = KernelSpec("layernorm.rmsnorm", B.TORCH, "m:f")
    assert (spec.group, spec.name) == ("layernorm", "rmsnorm")


@pytest.mark.parametrize("make, error, message", [
    # These used to raise AttributeError, or be accepted and make select_kernel raise AttributeError later:
    (lambda: KernelSpec("x.y", B.TORCH, None), TypeError, "target must be a 'module:attr' string"),
    (lambda: KernelSpec(None, B.TORCH, "m:f"), TypeError, "KernelSpec.op must be the op's name"),
    (lambda: KernelSpec("x.y", B.TORCH, "m:f", capabilities=["cuda"]), TypeError,
     "capabilities must be CapabilityRequirement values"),
    (lambda: KernelSpec("x.y", B.TORCH, "m:f", capabilities="cuda"), TypeError,
     "capabilities must be CapabilityRequirement values"),
    (lambda: KernelSpec("x.y", B.TORCH, "m:f", requires=[None]), TypeError, "requires must be package import names"),
    (lambda: Cap("gpu"), ValueError, "CapabilityRequirement device 'gpu' is not a device type"),
    (lambda: Cap.cuda(min_sm=9), TypeError, "min_cuda_arch must be (major, minor) integers"),
])
def test_bad_spec_values_are_type_or_value_errors_at_construction(make, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_a_device_given_as_text_is_parsed():
    # CapabilityRequirement("cuda") used to be accepted as a str and make select_kernel raise AttributeError.
    assert Cap("cuda") == Cap.CUDA and Cap("cuda").unmet_reason(CPU) == "needs cuda, device is cpu"


def test_a_shape_value_json_cannot_store_is_refused_at_registration_naming_op_and_key():
    # It was accepted, and the tune failed after every check and timing with a bare "Object of type dtype is not
    # JSON serializable" (and `autosel tune` printed a traceback).
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^shape 1 of op 'x.y' holds dtype=torch.bfloat16, which cannot be stored as "
                                        r"JSON; give shapes as numbers, strings and booleans"):
        OpDefinition("x.y", shapes=[{"n": 4}, {"n": 8, "dtype": torch.bfloat16}], make_inputs=lambda s, d: ())
    late = OpDefinition("x.y", shapes=lambda platform: [{"n": 4, "dtype": torch.float16}], make_inputs=lambda s, d: ())
    with pytest.raises(TypeError, match=r"^shape 0 of op 'x.y' holds dtype=torch.float16"):
        late.shapes_for(CPU)


@pytest.mark.parametrize("target, error, says", [
    ("json:no_such_function", AttributeError, "module 'json' has no attribute 'no_such_function'"),
    ("no_such_module_xyz:f", ModuleNotFoundError, "No module named 'no_such_module_xyz'"),
])
def test_a_target_that_cannot_be_loaded_names_op_backend_and_target(target, error, says):
    # A bare "module 'x' has no attribute 'y'" named neither the op nor the registration to fix.
    with pytest.raises(error, match=re.escape(f"kernel 'my.op' backend 'torch': cannot load its target {target!r}: "
                                              f"{says}")):
        KernelSpec("my.op", B.TORCH, target).load()


def test_traced_may_return_what_custom_op_returns_and_must_return_a_callable():
    # A CustomOpDef in compiled code failed with "does not know how to wrap CustomOpDef"; None failed only when
    # compiled, with torch's words for it.
    import torch

    @torch.library.custom_op("autosel_test::scale_aot", mutates_args=(), schema="(Tensor x) -> Tensor")
    def scale(x):
        return x * 2

    scale.register_fake(lambda x: torch.empty_like(x))
    definition = OpDefinition("my.scale", shapes=[{"n": 1}], make_inputs=lambda shape, device: (),
                              traced=lambda backend, kernel: scale)
    assert definition.traced_kernel("aot", print) is torch.ops.autosel_test.scale_aot.default
    broken = OpDefinition("my.scale", shapes=[{"n": 1}], make_inputs=lambda shape, device: (),
                          traced=lambda backend, kernel: None)
    with pytest.raises(TypeError, match=r"^traced for op 'my\.scale' returned None for backend 'aot': it must return"):
        broken.traced_kernel("aot", print)


def test_a_traced_target_is_checked_at_registration_and_one_that_cannot_load_names_the_op():
    # "nocolon" was accepted and failed at get_kernel with a bare "No module named 'nocolon'", eager use too.
    def definition(traced):
        return OpDefinition("my.scale", shapes=[{"n": 1}], make_inputs=lambda shape, device: (), traced=traced)

    with pytest.raises(ValueError, match=r"^traced for op 'my\.scale' must be a 'module:function' target such as "
                                         r"'mypkg\.compiled:opaque', got 'nocolon'$"):
        definition("nocolon")
    with pytest.raises(AttributeError, match=r"^op 'my\.scale': cannot load its traced= target 'json:nope': module "
                                             r"'json' has no attribute 'nope'$"):
        definition("json:nope").traced_kernel("aot", print)
