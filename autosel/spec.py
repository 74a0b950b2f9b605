"""What a kernel is: its backend, where it lives ("module:attr"), where it can run, and what an op needs to be tuned."""

from __future__ import annotations

import difflib
import enum
import importlib
import importlib.util
import json
import math
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

if TYPE_CHECKING:
    from autosel.platforms import PlatformInfo


class KernelBackend(str, enum.Enum):
    """Provenance of an implementation, not the device it runs on. An engine's own provenance that is not listed
    here is declared once with KernelBackend.declare("name"), before its specs are registered."""

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
    # Listed by sglang's newest enum (sglang.kernels.spec); KDA's value is upper case there too.
    FLYDSL = "flydsl"
    KDA = "KDA"
    MLX = "mlx"
    SGL_KERNEL_NPU = "sgl_kernel_npu"

    @classmethod
    def declare(cls, value: str) -> "KernelBackend":
        """The member for `value`, added to the enum if it is not a known backend or a spelling of one: a new
        provenance an engine brings (upstream's enum grows faster than autosel's list). Idempotent. Every process
        that reads specs naming it declares it, as the engine's registration code runs there (autosel tune's worker
        processes load the same plug-ins); an undeclared name stays an error, so a typo is not a new backend."""
        try:
            return cls.parse(value)
        except ValueError:
            pass
        if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", value):
            raise ValueError(f"a backend name must be a letter then letters, digits or '_', such as 'flydsl'; "
                             f"got {value!r}")
        with _DECLARE_LOCK:
            if value in cls._value2member_map_:
                return cls._value2member_map_[value]
            member = str.__new__(cls, value)
            member._name_, member._value_ = value.upper(), value
            member.__objclass__ = cls
            cls._value2member_map_[value] = member
            cls._member_map_.setdefault(member._name_, member)
            cls._member_names_.append(member._name_)
            return member

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
        raise ValueError(f"unknown kernel backend {value!r}{hint}; known backends: {known}. An engine's own backend "
                         f"is declared once, before its specs: KernelBackend.declare({str(value)!r})") from None


_DECLARE_LOCK = threading.Lock()  # not in autosel.state, which this layer does not import: renewed in a forked child


def _after_fork_in_child() -> None:
    global _DECLARE_LOCK
    _DECLARE_LOCK = threading.Lock()  # one another thread of the parent held at the fork would be held for good


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
    "sgl_kernel": "sglang-kernel",  # since 0.4; the old sgl-kernel (0.3.x) does not run with current torch
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

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "device", DeviceType(self.device))
        except ValueError:
            known = ", ".join(d.value for d in DeviceType)
            raise ValueError(f"CapabilityRequirement device {self.device!r} is not a device type; known: {known}") \
                from None
        for name in ("min_cuda_arch", "max_cuda_arch"):
            arch = getattr(self, name)
            if arch is None:
                continue
            if (isinstance(arch, str) or not hasattr(arch, "__len__") or len(arch) != 2
                    or not all(isinstance(n, int) and not isinstance(n, bool) for n in arch)):
                raise TypeError(f"CapabilityRequirement {name} must be (major, minor) integers such as (8, 0), "
                                f"got {arch!r}")
            object.__setattr__(self, name, tuple(arch))

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


def capabilities_satisfied(capabilities: "CapabilityRequirement | Iterable[CapabilityRequirement]",
                           platform: "PlatformInfo") -> bool:
    """Whether a kernel with these capabilities can run on `platform`: any one of them satisfied (a set is an OR),
    an empty set meaning anywhere, a single requirement taken as a set of one. sglang.kernels exports the same."""
    if isinstance(capabilities, CapabilityRequirement):
        capabilities = (capabilities,)
    capabilities = tuple(capabilities)
    return not capabilities or any(c.is_satisfied_by(platform) for c in capabilities)


@dataclass(frozen=True)
class FormatSignature:
    """What a kernel takes and does, for people and inventories, never for selection: the dtypes it supports,
    whether it writes its output in place. sglang.kernels' spec field of the same name."""

    supported_dtypes: tuple[str, ...] = ()
    in_place: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        dtypes = (self.supported_dtypes,) if isinstance(self.supported_dtypes, str) else self.supported_dtypes
        if not isinstance(dtypes, Iterable) or not all(isinstance(d, str) for d in dtypes):
            raise TypeError(f"FormatSignature.supported_dtypes must be dtype names such as ('bfloat16', 'float16'), "
                            f"got {self.supported_dtypes!r}")
        object.__setattr__(self, "supported_dtypes", tuple(dtypes))
        if not isinstance(self.in_place, bool) or not isinstance(self.description, str):
            raise TypeError(f"FormatSignature.in_place must be a bool and description text, got "
                            f"{self.in_place!r} and {self.description!r}")


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


def _as_capabilities(caps: Any, what: str) -> frozenset[CapabilityRequirement]:
    if isinstance(caps, CapabilityRequirement):
        return frozenset([caps])
    if isinstance(caps, (str, bytes)) or not isinstance(caps, Iterable):
        raise TypeError(f"{what}: capabilities must be CapabilityRequirement values, e.g. "
                        f"{{CapabilityRequirement.cuda(min_sm=(8, 0))}}, got {caps!r}")
    caps = list(caps)
    for cap in caps:
        if not isinstance(cap, CapabilityRequirement):
            raise TypeError(f"{what}: capabilities must be CapabilityRequirement values, e.g. "
                            f"CapabilityRequirement.cuda(min_sm=(8, 0)), got {cap!r} ({type(cap).__name__})")
    return frozenset(caps)


def _as_requires(requires: Any, what: str) -> tuple[str, ...]:
    if isinstance(requires, str):
        requires = (requires,)
    if not isinstance(requires, Iterable):
        raise TypeError(f"{what}: requires must be package import names such as ('flashinfer',), got {requires!r}")
    requires = tuple(requires)
    for name in requires:
        if not isinstance(name, str) or not name.strip():
            raise TypeError(f"{what}: requires must be package import names such as ('flashinfer',), "
                            f"got {name!r} among {requires!r}")
    return requires


# Twice the largest float32: an atol this large passes every finite float32, float16 or bfloat16 output.
_ATOL_PASSES_ALL = 2 * 3.4028234663852886e38


def check_tolerance(name: str, value: Any, op: str) -> None:
    """None, or a finite non-negative number that can fail: NaN would make every comparison pass and switch the
    check off, and so does a tolerance no output can exceed (rtol=1e308 let a kernel wrong everywhere win)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} for op {op!r} must be a number or None, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r} for op {op!r} is not a finite non-negative tolerance; pass e.g. "
                         f"{name}=1e-2, or None for the dtype's default")
    if name == "rtol" and value >= 1:
        raise ValueError(f"rtol={value!r} for op {op!r} lets an output be off by {value:g} times the reference's "
                         "size, so all zeros (or a wrong sign, from rtol=2) pass: a check that cannot fail. Pass a "
                         "relative tolerance below 1, e.g. rtol=1e-2, or None for the dtype's default")
    if name == "atol" and value >= _ATOL_PASSES_ALL:
        raise ValueError(f"atol={value!r} for op {op!r} is over twice the largest float32 ({_ATOL_PASSES_ALL / 2:g}), "
                         "so every finite float32, float16 or bfloat16 output passes: a check that cannot fail. "
                         "Pass an absolute tolerance in the outputs' scale, e.g. atol=1e-2, or None for the dtype's "
                         "default")


@dataclass(frozen=True)
class KernelSpec:
    """One implementation of one op. Registration is metadata only: nothing is imported until load()."""

    op: str
    backend: KernelBackend
    target: str
    capabilities: frozenset[CapabilityRequirement] = frozenset()
    requires: tuple[str, ...] = ()
    description: str = ""
    format_signature: FormatSignature = FormatSignature()

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or not self.op:
            raise TypeError(f"KernelSpec.op must be the op's name, e.g. 'layernorm.rmsnorm', got {self.op!r}")
        object.__setattr__(self, "backend", KernelBackend.parse(self.backend))
        what = f"KernelSpec {self.op!r} backend {self.backend.value!r}"
        object.__setattr__(self, "capabilities", _as_capabilities(self.capabilities, what))
        object.__setattr__(self, "requires", _as_requires(self.requires, what))
        if not isinstance(self.description, str):
            raise TypeError(f"{what}: description must be text, got {self.description!r}")
        if not isinstance(self.format_signature, FormatSignature):
            raise TypeError(f"{what}: format_signature must be a FormatSignature, got {self.format_signature!r}")
        if not isinstance(self.target, str):
            raise TypeError(f"{what}: target must be a 'module:attr' string such as 'mypkg.kernels:rmsnorm', "
                            f"got {self.target!r} ({type(self.target).__name__})")
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
        """capabilities_satisfied, and every required package installed (found by metadata, never imported)."""
        return self.unavailable_reason(platform) is None

    def load(self) -> Callable[..., Any]:
        """Import the target module and follow the dotted attribute path."""
        try:
            return resolve_target(self.target)
        except (ImportError, AttributeError) as exc:
            missing = self.missing_packages() if isinstance(exc, ImportError) else []
            if missing:
                raise ImportError(
                    f"kernel {self.op!r} backend {self.backend.value!r} needs the Python package "
                    f"{missing[0]!r}, which is not installed (pip install {pip_name(missing[0])})",
                    name=missing[0],
                ) from exc
            # A bare "module 'x' has no attribute 'y'" named neither the op nor the registration to fix.
            raise type(exc)(f"kernel {self.op!r} backend {self.backend.value!r}: cannot load its target "
                            f"{self.target!r}: {exc}") from exc


@dataclass(frozen=True)
class OpDefinition:
    """What tuning an op needs: representative shapes, an input factory, a reference and tolerances.

    `shapes` is a list of JSON-serialisable dicts, or a callable taking the PlatformInfo and returning
    one (so a CPU host need not time 16k-token GEMMs). `make_inputs(shape, device)` returns the
    positional arguments of one call. An op whose kernels return None works in place: its tensor
    arguments after the call are its output. `shape_of(*args)`, the inverse of make_inputs, returns the
    shape of a real call as a dict (token counts rounded to a power of two); AUTOSEL_RECORD uses it.
    `bucket(*args)` returns the shape bucket of a call as a tuple of JSON scalars, such as (tokens rounded
    to a power of two, hidden): exactly int, finite float, str or bool values, one type at each place (True
    and 1 are one dict key), at most 256 characters as JSON (decisions.bucket_problem); a dispatcher
    (autosel.dispatch) runs it on calls, so it must cost well under a microsecond. Without it the op has one decision, not one per bucket. `route_key`: the index of a
    positional argument whose shape alone decides the bucket, or two such indices; the dispatcher then looks
    calls up by those shapes and runs `bucket` once per distinct shape.
    `signature` is documentation only: how every backend of the op is called, what it returns or changes in
    place, and its dtypes (`autosel doctor` shows it).
    `traced`: what torch.compile should call in place of a kernel of the op, as a function (backend name, kernel)
    -> callable, or its "module:function" target: a torch custom op around the kernel, for kernels it cannot trace
    or would compile once per shape (autosel.ops.opaque). None: the kernels are traced as they are.
    `activations`: the indices of the positional arguments that, in a model, the ops before this one have just
    written (its activations, not its weights or caches). Graph-mode timing writes them before each timed call and
    takes the writes' own time off, so they are where a model leaves them (docs/TUNING.md section 2).
    `planned`: the op's kernels are plan classes (autosel.planned): `Plan(batch)` does the per-batch work once,
    then `plan.run(*rest)` runs many times. make_inputs then returns (batch, *rest), bucket and shape_of read the
    batch (their first argument), activations and weights index `rest`, and get_kernel returns a Planner whose
    `plan(batch)` builds the bucket's winner's plan; the tuner times `plan.run` with the plan built beforehand.
    `weights`: the indices of the positional arguments that a model reads from memory at every call: a layer's
    own weights, which the rest of a step evicts from the L2 before the layer runs again. Graph-mode timing gives
    each captured call the next of enough copies of them to exceed the L2, so a weight that would fit there is not
    timed from it. Worth declaring where the weight is megabytes (gemm.mm's b), not for a norm's vector.
    """

    op: str
    shapes: Any
    make_inputs: Callable[[dict, str], tuple]
    reference: KernelBackend | Callable[..., Any] | None = None
    rtol: float | None = None
    atol: float | None = None
    shape_of: Callable[..., dict] | None = None
    bucket: Callable[..., tuple] | None = None
    route_key: int | tuple[int, int] | None = None
    signature: str = ""
    traced: str | Callable[[str, Callable[..., Any]], Callable[..., Any]] | None = None
    activations: tuple[int, ...] = (0,)
    weights: tuple[int, ...] = ()
    planned: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or not self.op:
            raise TypeError(f"op must be the op's name, e.g. 'layernorm.rmsnorm', got {self.op!r}")
        if not callable(self.make_inputs):
            raise TypeError(f"make_inputs for op {self.op!r} must be a function (shape, device) -> args, "
                            f"got {self.make_inputs!r}")
        if self.shape_of is not None and not callable(self.shape_of):
            raise TypeError(f"shape_of for op {self.op!r} must be a function (*args) -> shape or None, "
                            f"got {self.shape_of!r}")
        if self.traced is not None and not (callable(self.traced) or isinstance(self.traced, str)):
            raise TypeError(f"traced for op {self.op!r} must be a function (backend, kernel) -> callable, its "
                            f"'module:function' target, or None; got {self.traced!r}")
        if isinstance(self.traced, str) and not all(self.traced.partition(":")[::2]):
            raise ValueError(f"traced for op {self.op!r} must be a 'module:function' target such as "
                             f"'mypkg.compiled:opaque', got {self.traced!r}")
        if self.bucket is not None and not callable(self.bucket):
            raise TypeError(f"bucket for op {self.op!r} must be a function (*args) -> tuple or None, "
                            f"got {self.bucket!r}")
        indices = self.route_key if isinstance(self.route_key, tuple) else (self.route_key,)
        if self.route_key is not None and (len(indices) not in (1, 2) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices)):
            raise TypeError(f"route_key for op {self.op!r} must be the index of a positional argument whose shape "
                            f"decides the bucket (0 for the first), two such indices, or None; got {self.route_key!r}")
        for name, example in (("activations", "(0,) for the first"), ("weights", "(1,) for the second")):
            indices = getattr(self, name)
            if not (isinstance(indices, tuple) and all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices)):
                raise TypeError(f"{name} for op {self.op!r} must be a tuple of positional argument indices, such "
                                f"as {example}; got {indices!r}")
        if set(self.activations) & set(self.weights):
            raise ValueError(f"op {self.op!r}: argument(s) {sorted(set(self.activations) & set(self.weights))} are "
                             "both activations (written just before the call) and weights (read from memory); "
                             "name each argument in one of the two")
        if not (self.reference is None or isinstance(self.reference, KernelBackend) or callable(self.reference)):
            raise TypeError(f"reference for op {self.op!r} must be a backend name, a KernelBackend, a function or "
                            f"None (its torch backend), got {self.reference!r}")
        if not callable(self.shapes) and (isinstance(self.shapes, (str, bytes)) or not isinstance(self.shapes, Iterable)):
            raise TypeError(f"shapes for op {self.op!r} must be a list of dicts or a function of the platform, "
                            f"got {self.shapes!r}")
        if isinstance(self.shapes, (list, tuple)):
            check_shapes(self.op, self.shapes)
        check_tolerance("rtol", self.rtol, self.op)
        check_tolerance("atol", self.atol, self.op)

    def traced_kernel(self, backend: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
        """What torch.compile calls in place of `kernel` (this op's `backend`): `traced`'s answer, else the kernel.
        What `@torch.library.custom_op` returns (a CustomOpDef, which dynamo cannot hold in a graph) is taken as
        its OpOverload, `torch.ops.NS.NAME.default`."""
        if self.traced is None:
            return kernel
        try:
            traced = resolve_target(self.traced) if isinstance(self.traced, str) else self.traced
        except (ImportError, AttributeError) as exc:
            raise type(exc)(f"op {self.op!r}: cannot load its traced= target {self.traced!r}: {exc}") from exc
        answer = traced(backend, kernel)
        answer = getattr(answer, "_opoverload", answer)  # a CustomOpDef's OpOverload
        if not callable(answer):
            raise TypeError(f"traced for op {self.op!r} returned {answer!r} for backend {backend!r}: it must return "
                            "what torch.compile calls in place of the kernel (a torch custom op around it, or the "
                            "kernel itself to trace it as it is)")
        return answer

    @property
    def checked_with(self) -> str:
        """What a candidate's correctness is judged by: the tolerances and the reference. Stored with each decision;
        one made under others is not the op's answer now (a winner the current check might reject)."""
        ref = self.reference
        name = ("the op's torch backend" if ref is None else ref.value if isinstance(ref, KernelBackend)
                else f"{getattr(ref, '__module__', '?')}:{getattr(ref, '__qualname__', type(ref).__name__)}")
        return f"rtol={self.rtol}, atol={self.atol}, reference {name}"

    def shapes_for(self, platform: "PlatformInfo") -> list[dict]:
        if not callable(self.shapes):
            return [dict(s) for s in self.shapes]
        return check_shapes(self.op, [dict(s) for s in self.shapes(platform)])


def check_shapes(op: str, shapes) -> list:
    """Each shape a dict of JSON values: shapes are stored as evidence (JSON) beside every decision, so a value JSON
    cannot hold (a torch.dtype, say) would fail only once the whole tune had run."""
    for index, shape in enumerate(shapes):
        if problem := shape_problem(shape):
            raise TypeError(f"shape {index} of op {op!r} {problem}")
    return list(shapes)


def shape_problem(shape) -> str:
    """What keeps `shape` from being a shape (a dict of JSON values under string keys), "" when it is one: what
    check_shapes says of a declared shape and the AUTOSEL_RECORD recorder of what a shape_of returned."""
    if not isinstance(shape, Mapping):
        return f"must be a dict such as {{'tokens': 64, 'hidden': 4096}}, got {shape!r}"
    for key, value in shape.items():
        if not isinstance(key, str):
            return f"has the key {key!r}; shape keys are strings"
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            return (f"holds {key}={value!r}, which cannot be stored as JSON; give shapes as numbers, strings and "
                    "booleans (a dtype by its name, 'bfloat16', which make_inputs reads)")
    return ""


def spec_list(specs: Iterable[KernelSpec]) -> list[str]:
    return [s.backend.value for s in specs]
