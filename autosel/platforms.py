"""The machine autosel runs on: detecting it (device type, architecture, device name, multiprocessor count and
versions, and the version vector decisions are keyed by), how near a stored platform key is to it (AUTOSEL_MATCH's
ranking: platform_nearness, near_rank, MATCH_ACCEPTS), whether a CUDA graph is being captured on it
(capturing_cuda_graph), which execution modes a device type has (modes_for_device), which GPU a child process sees
as its own (visible_gpu_name) and which packages every process compiles again for want of bytecode
(missing_bytecode)."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import platform as _stdlib_platform
import re
import sys
from dataclasses import dataclass, field
from typing import Callable

from autosel.spec import DeviceType

log = logging.getLogger(__name__)

# Backend packages whose versions can change a decision; recorded when installed (by metadata only).
KNOWN_BACKEND_DISTRIBUTIONS = ("flashinfer-python", "sglang-kernel", "sgl-kernel", "deep-gemm", "aiter")


def normalise_device_name(name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200': spaces to underscores, other separators collapsed, kept otherwise."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", name.strip()).strip("_") or "unknown"


def key_fields(key: str) -> tuple[str, str, str, str]:
    """(device type, arch, device name, multiprocessor count) of a platform key, as PlatformInfo.key writes it."""
    parts = key.split("/")
    return tuple(parts) if len(parts) == 4 else (key, "", "", "")  # type: ignore[return-value]


def platform_nearness(stored: str, current: str) -> str | None:
    """How a stored decision's platform key relates to this machine's: "device" (the same key), "arch" (the same
    device type and a known arch, another model or multiprocessor count: an H100 row on an H200) or None."""
    if stored == current:
        return "device"
    a, b = key_fields(stored), key_fields(current)
    return "arch" if a[:2] == b[:2] and a[1] not in ("", "unknown") else None


# What each AUTOSEL_MATCH setting accepts besides the exact key, closest first.
MATCH_ACCEPTS = {"exact": (), "device": ("device",), "arch": ("device", "arch")}


def near_rank(stored: str, current: str, match: str) -> int | None:
    """Where a stored row of another version vector or platform ranks under AUTOSEL_MATCH=`match` (0: the same
    device, 1: the same arch), or None when the setting does not accept it."""
    accepts = MATCH_ACCEPTS[match]
    nearness = platform_nearness(stored, current)
    return accepts.index(nearness) if nearness in accepts else None


# Every execution mode a decision can be made in (AUTOSEL_MODE's values; docs/DESIGN.md section 3).
EXECUTION_MODES = ("eager", "graph")
# Device types with CUDA graphs (HIP's through torch.cuda): selection and tuning there have a graph mode too.
_GRAPH_DEVICE_TYPES = ("cuda", "hip")


def modes_for_device(device_type: str) -> tuple[str, ...]:
    """The execution modes a device type selects and tunes in: eager and graph where CUDA graphs are replayed
    (prefill launches eagerly, decode replays graphs), else eager only. device_type: PlatformInfo.device's value,
    or a platform key's first field (key_fields)."""
    return EXECUTION_MODES if device_type in _GRAPH_DEVICE_TYPES else ("eager",)


@functools.lru_cache(maxsize=None)
def distribution_version(dist: str) -> str | None:
    """The installed version of a distribution, read once per process: each read scans sys.path's metadata
    (0.28 s per version vector on the H200's host, 6.8 s of a tune, cProfile: commit 6115e12), and a package
    upgraded under a running process stays the version it imported."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class PlatformInfo:
    """The facts a decision depends on. Build it with detect(); tests construct it directly."""

    device_type: str = "cpu"
    cuda_arch_major: int | None = None
    cuda_arch_minor: int | None = None
    arch: str = ""
    device_name: str = ""
    multiprocessor_count: int = 0
    versions: tuple[tuple[str, str], ...] = field(default=())

    @property
    def device(self) -> DeviceType:
        try:
            return DeviceType(self.device_type)
        except ValueError:
            return DeviceType.CPU

    @property
    def cuda_arch(self) -> tuple[int, int] | None:
        if self.cuda_arch_major is None:
            return None
        return (self.cuda_arch_major, self.cuda_arch_minor or 0)

    @property
    def is_cuda(self) -> bool:
        return self.device == DeviceType.CUDA

    @property
    def is_hip(self) -> bool:
        return self.device == DeviceType.HIP

    @property
    def torch_device(self) -> str:
        """The torch device string tensors for this platform live on (HIP uses 'cuda' in torch)."""
        return {"cuda": "cuda", "hip": "cuda", "xpu": "xpu", "mps": "mps", "npu": "npu"}.get(
            self.device.value, "cpu"
        )

    @property
    def key(self) -> str:
        """Platform key of a decision: device type, arch, normalised name, multiprocessor count."""
        arch = self.arch or (f"sm_{self.cuda_arch_major}{self.cuda_arch_minor or 0}" if self.cuda_arch else "")
        name = normalise_device_name(self.device_name) if self.device_name else "unknown"
        return f"{self.device.value}/{arch or 'unknown'}/{name}/{self.multiprocessor_count}"

    @property
    def version_map(self) -> dict[str, str]:
        return dict(self.versions)

    @classmethod
    def detect(cls, device_index: int = 0) -> "PlatformInfo":
        """Never raises: anything that fails to answer leaves the CPU defaults in place. device_index: which of
        the visible GPUs (autosel.parallel asks for each one it spreads tune jobs over)."""
        try:
            return _detect(device_index)
        except Exception as exc:  # detection must not take selection down
            log.warning("platform detection failed (%s: %s); assuming a CPU", type(exc).__name__, exc)
            return _cpu_platform({})


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _stdlib_platform.processor() or _stdlib_platform.machine() or "cpu"


def _cpu_platform(versions: dict[str, str]) -> PlatformInfo:
    return PlatformInfo(
        device_type="cpu",
        arch=_stdlib_platform.machine() or "unknown",
        device_name=_cpu_name(),
        multiprocessor_count=os.cpu_count() or 0,
        versions=tuple(sorted(versions.items())),
    )


def _driver_major() -> str | None:
    # The kernel module's version file is the cheapest source that needs no NVML binding.
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+)\.", f.read())
            return match.group(1) if match else None
    except OSError:
        return None


def _detect(index: int = 0) -> PlatformInfo:
    versions: dict[str, str] = {}
    for dist in KNOWN_BACKEND_DISTRIBUTIONS + ("triton",):
        version = distribution_version(dist)
        if version:
            versions[dist] = version
    try:
        import torch
    except ImportError:
        return _cpu_platform(versions)
    versions["torch"] = torch.__version__
    if torch.version.hip and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(index)
        versions["hip"] = str(torch.version.hip)
        return PlatformInfo(
            device_type="hip",
            arch=str(getattr(props, "gcnArchName", "") or "").split(":")[0],
            device_name=props.name,
            multiprocessor_count=props.multi_processor_count,
            versions=tuple(sorted(versions.items())),
        )
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(index)
        versions["cuda"] = str(torch.version.cuda)
        driver = _driver_major()
        if driver:
            versions["driver_major"] = driver
        return PlatformInfo(
            device_type="cuda",
            cuda_arch_major=props.major,
            cuda_arch_minor=props.minor,
            arch=f"sm_{props.major}{props.minor}",
            device_name=props.name,
            multiprocessor_count=props.multi_processor_count,
            versions=tuple(sorted(versions.items())),
        )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return PlatformInfo(device_type="mps", arch="apple", device_name="Apple MPS",
                            versions=tuple(sorted(versions.items())))
    return _cpu_platform(versions)


@functools.lru_cache(maxsize=1)
def current_platform() -> PlatformInfo:
    """The detected platform, once per process (the device does not change under a running engine)."""
    return PlatformInfo.detect()


_capture_check: Callable[[], bool] | None = None


def visible_gpu_name(index: int) -> str:
    """What CUDA_VISIBLE_DEVICES must say for a child process to see this process's GPU `index` as its device 0:
    that entry of this process's own CUDA_VISIBLE_DEVICES (under "2,3", GPU 0 is the one named 2), else the index."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def capturing_cuda_graph() -> bool:
    """True while a CUDA graph is being captured on the current stream; never imports torch itself.

    Called on every warm get_kernel, so the check is resolved once: without CUDA it is False for good; with
    CUDA it is torch's own capture query (a C call).
    """
    global _capture_check
    if _capture_check is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return False  # not resolved yet: torch may be imported later
        try:
            cuda = torch.cuda.is_available()
        except Exception:
            cuda = False
        _capture_check = ((getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
                           or torch.cuda.is_current_stream_capturing) if cuda else _never)
    try:
        return bool(_capture_check())
    except Exception:
        return False


def _never() -> bool:
    return False


# Packages whose versions matter for every decision, when installed: they run or compile the kernels.
_BASE_VERSION_KEYS = ("torch", "cuda", "hip", "driver_major")
# ...and on a GPU also Triton, which torch.compile generates its GPU kernels with (on a CPU it emits C++).
_GPU_VERSION_KEYS = ("triton",)


@functools.lru_cache(maxsize=None)
def _distribution_of(package: str) -> str:
    """The distribution that installs import package `package`: the one of that name where there is one (torch,
    triton, sgl_kernel: one look-up), else the one whose files hold it (flashinfer-python), found by
    packages_distributions, which reads every installed distribution's file list (about 0.1 s of a process's first
    get_kernel when it was asked first)."""
    try:
        importlib.metadata.distribution(package)
        return package
    except importlib.metadata.PackageNotFoundError:
        pass
    names = importlib.metadata.packages_distributions().get(package) or [package]
    return names[0]


def version_vector(platform: PlatformInfo, specs) -> dict[str, str]:
    """The versions that can change which candidate wins or whether it runs, on this platform, among these
    specs (docs/DESIGN.md section 3). Triton counts on a GPU or when a spec requires it, so installing
    it on a CPU host does not turn that host's decisions stale. A changed vector is a new key: rows stored
    under an older vector are a miss, not an error."""
    keys = _BASE_VERSION_KEYS + (_GPU_VERSION_KEYS if platform.is_cuda or platform.is_hip else ())
    versions = {k: v for k, v in platform.versions if k in keys}
    for spec in specs:
        for package in spec.requires:
            top = package.partition(".")[0]
            version = distribution_version(_distribution_of(top))
            if version:
                versions[top] = version
        if spec.target.startswith("autosel."):  # our own kernels change with autosel releases
            versions["autosel"] = distribution_version("autosel") or "dev"
    return versions


def installed_version(name: str) -> str | None:
    """The version installed here of a version vector's entry (torch, triton, flashinfer, sgl_kernel, autosel...),
    read as version_vector reads it; None when it is not installed."""
    if name == "autosel":
        return distribution_version("autosel") or "dev"
    return distribution_version(_distribution_of(name))


# The packages whose imports a tune pays in every process (and every `autosel tune --devices` worker).
BYTECODE_PACKAGES = ("torch", "triton", "flashinfer", "sgl_kernel")


def missing_bytecode(packages: tuple[str, ...] | None = None, *, dont_write: bool | None = None) -> list[str]:
    """The installed `packages` whose Python source every process compiles again: no bytecode cached for their
    __init__.py (beside it, or under PYTHONPYCACHEPREFIX) and none will be written, because Python is told not
    to (PYTHONDONTWRITEBYTECODE) or cannot write there. On the H200 machine's image that made importing torch's
    compiler and flashinfer take 14-16 s instead of 5 s in every process (commit 90bab00).
    `packages` defaults to BYTECODE_PACKAGES, `dont_write` to this interpreter's setting."""
    import importlib.util

    packages = BYTECODE_PACKAGES if packages is None else packages
    dont_write = sys.dont_write_bytecode if dont_write is None else dont_write
    missing = []
    for package in packages:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        cached = importlib.util.cache_from_source(spec.origin)
        if os.path.exists(cached):
            continue
        folder = os.path.dirname(cached)
        while folder and not os.path.exists(folder):
            folder = os.path.dirname(folder)
        if dont_write or not os.access(folder or ".", os.W_OK):
            missing.append(package)
    return missing
