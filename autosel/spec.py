"""What a kernel is: its backend, where it lives ("module:attr"), where it can run, and what an op needs to be tuned."""

from __future__ import annotations

import difflib
import enum
import importlib
import importlib.util
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from autosel.platforms import PlatformInfo


class KernelBackend(str, enum.Enum):
    """Provenance of an implementation, not the device it runs on."""

    TORCH = "torch"
    TORCH_COMPILE = "torch_compile"
    TRITON = "triton"
    JIT = "jit"
    AOT = "aot"
    CUTE_DSL = "cute_dsl"
    FLASHINFER = "flashinfer"
    SGL_KERNEL = "sgl_kernel"
    DEEPGEMM = "deepgemm"
    AITER = "aiter"
    TORCH_NPU = "torch_npu"

    @classmethod
    def parse(cls, value: "KernelBackend | str") -> "KernelBackend":
        """Accept an enum member, its value, or the spelling people write ("sgl-kernel", "torch.compile",
        "DeepGEMM"); anything else is a ValueError naming the close match, if any, and the known values."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            pass
        spelt = _spelling(str(value))
        for backend in cls:
            if _spelling(backend.value) == spelt:
                return backend
        close = difflib.get_close_matches(spelt, [_spelling(b.value) for b in cls], n=1, cutoff=0.75)
        hint = "".join(f" (did you mean {b.value!r}?)" for b in cls if close and _spelling(b.value) == close[0])
        known = ", ".join(b.value for b in cls)
        raise ValueError(f"unknown kernel backend {value!r}{hint}; known backends: {known}") from None


def _spelling(name: str) -> str:
    """What is left of a backend name once case and separators are ignored: 'sgl-kernel' -> 'sglkernel'."""
    return re.sub(r"[\s._-]+", "", name.lower())


class DeviceType(str, enum.Enum):
    CUDA = "cuda"
    HIP = "hip"
    NPU = "npu"
    XPU = "xpu"
    MPS = "mps"
    CPU = "cpu"


# Import name -> the name to give pip, for the packages kernels commonly need.
PIP_NAMES = {
    "flashinfer": "flashinfer-python",
    "sgl_kernel": "sgl-kernel",
    "triton": "triton",
    "torch": "torch",
    "deep_gemm": "deep-gemm",
    "aiter": "aiter",
}


def pip_name(package: str) -> str:
    return PIP_NAMES.get(package, package.replace("_", "-"))


def format_arch(arch: tuple[int, int]) -> str:
    return f"sm_{arch[0]}{arch[1]}"


@dataclass(frozen=True)
class CapabilityRequirement:
    """One place a kernel can run: a device type and, on CUDA, inclusive compute-capability bounds."""

    device: DeviceType
    min_cuda_arch: tuple[int, int] | None = None
    max_cuda_arch: tuple[int, int] | None = None

    @classmethod
    def cuda(cls, min_sm: tuple[int, int] | None = None, max_sm: tuple[int, int] | None = None):
        return cls(DeviceType.CUDA, min_sm, max_sm)

    def unmet_reason(self, platform: "PlatformInfo") -> str | None:
        """None when satisfied, else a sentence naming both sides."""
        if platform.device != self.device:
            return f"needs {self.device.value}, device is {platform.device.value}"
        arch = platform.cuda_arch
        if self.device != DeviceType.CUDA or arch is None:
            return None  # bounds only apply to a known CUDA arch, as in the original selector
        if self.min_cuda_arch is not None and arch < tuple(self.min_cuda_arch):
            return f"needs {format_arch(self.min_cuda_arch)} or newer, device is {format_arch(arch)}"
        if self.max_cuda_arch is not None and arch > tuple(self.max_cuda_arch):
            return f"needs {format_arch(self.max_cuda_arch)} or older, device is {format_arch(arch)}"
        return None

    def is_satisfied_by(self, platform: "PlatformInfo") -> bool:
        return self.unmet_reason(platform) is None


CapabilityRequirement.CUDA = CapabilityRequirement(DeviceType.CUDA)  # type: ignore[attr-defined]
CapabilityRequirement.HIP = CapabilityRequirement(DeviceType.HIP)  # type: ignore[attr-defined]
CapabilityRequirement.NPU = CapabilityRequirement(DeviceType.NPU)  # type: ignore[attr-defined]


def resolve_target(target: str) -> Any:
    """Import the module of a "module:attr" target and follow the dotted attribute path."""
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def target_of(obj: Any) -> str | None:
    """The "module:attr" target that resolves back to `obj`, or None (lambdas, closures, locals)."""
    target = f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}"
    try:
        return target if "<" not in target and resolve_target(target) is obj else None
    except (ImportError, AttributeError, ValueError):
        return None


def _as_capabilities(caps: Any) -> frozenset[CapabilityRequirement]:
    if isinstance(caps, CapabilityRequirement):
        return frozenset([caps])
    return frozenset(caps)


@dataclass(frozen=True)
class KernelSpec:
    """One implementation of one op. Registration is metadata only: nothing is imported until load()."""

    op: str
    backend: KernelBackend
    target: str
    capabilities: frozenset[CapabilityRequirement] = frozenset()
    requires: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", KernelBackend.parse(self.backend))
        object.__setattr__(self, "capabilities", _as_capabilities(self.capabilities))
        requires = (self.requires,) if isinstance(self.requires, str) else tuple(self.requires)
        object.__setattr__(self, "requires", requires)
        module, sep, attr = self.target.partition(":")
        if not (module and sep and attr):
            raise ValueError(
                f"KernelSpec.target must be 'module:attr', got {self.target!r} for op {self.op!r} "
                f"backend {self.backend.value!r}; write it as e.g. 'mypkg.kernels:rmsnorm'"
            )

    @property
    def group(self) -> str:
        return self.op.partition(".")[0]

    @property
    def name(self) -> str:
        group, sep, name = self.op.partition(".")
        return name if sep else group

    def missing_packages(self) -> list[str]:
        """The required packages that are not installed, found by metadata only (nothing is imported)."""
        return [p for p in self.requires if importlib.util.find_spec(p.partition(".")[0]) is None]

    def unavailable_reason(self, platform: "PlatformInfo") -> str | None:
        """None when this spec can run on `platform`, else why not (device, arch bounds, missing package)."""
        if self.capabilities:
            reasons = [c.unmet_reason(platform) for c in sorted(self.capabilities, key=repr)]
            if all(reasons):
                return "; or ".join(r for r in reasons if r)
        missing = self.missing_packages()
        if missing:
            names = ", ".join(repr(p) for p in missing)
            installs = " ".join(pip_name(p) for p in missing)
            return f"package {names} is not installed (pip install {installs})"
        return None

    def is_available(self, platform: "PlatformInfo") -> bool:
        return self.unavailable_reason(platform) is None

    def load(self) -> Callable[..., Any]:
        """Import the target module and follow the dotted attribute path."""
        try:
            return resolve_target(self.target)
        except ImportError as exc:
            missing = self.missing_packages()
            if missing:
                raise ImportError(
                    f"kernel {self.op!r} backend {self.backend.value!r} needs the Python package "
                    f"{missing[0]!r}, which is not installed (pip install {pip_name(missing[0])})",
                    name=missing[0],
                ) from exc
            raise


@dataclass(frozen=True)
class OpDefinition:
    """What tuning an op needs: representative shapes, an input factory, a reference and tolerances.

    `shapes` is a list of JSON-serialisable dicts, or a callable taking the PlatformInfo and returning
    one (so a CPU host need not time 16k-token GEMMs). `make_inputs(shape, device)` returns the
    positional arguments of one call. An op whose kernels return None works in place: its tensor
    arguments after the call are its output. `shape_of(*args)`, the inverse of make_inputs, returns the
    shape of a real call as a dict (token counts rounded to a power of two); AUTOSEL_RECORD uses it.
    `bucket(*args)` returns the shape bucket of a call as a tuple of JSON scalars, such as (tokens rounded
    up to a power of two, hidden); it runs on every call of a dispatcher (autosel.dispatch), so it must
    cost well under a microsecond. Without it the op has one decision, not one per bucket.
    `signature` is documentation only: how every backend of the op is called, what it returns or changes in
    place, and its dtypes (`autosel doctor` shows it).
    """

    op: str
    shapes: Any
    make_inputs: Callable[[dict, str], tuple]
    reference: KernelBackend | Callable[..., Any] | None = None
    rtol: float | None = None
    atol: float | None = None
    shape_of: Callable[..., dict] | None = None
    bucket: Callable[..., tuple] | None = None
    signature: str = ""

    def shapes_for(self, platform: "PlatformInfo") -> list[dict]:
        shapes = self.shapes(platform) if callable(self.shapes) else self.shapes
        return [dict(s) for s in shapes]


def spec_list(specs: Iterable[KernelSpec]) -> list[str]:
    return [s.backend.value for s in specs]
