"""autosel: pick the fastest correct kernel backend per op by measuring, and keep the decision in SQLite.

Importing this package imports no torch, no triton and no backend package.
"""

from autosel.dispatch import by_tokens
from autosel.platforms import PlatformInfo
from autosel.registry import KernelRegistry, register_kernel, register_op, registry
from autosel.selector import clear_cache, get_kernel, select_kernel
from autosel.spec import (
    CapabilityRequirement, DeviceType, FormatSignature, KernelBackend, KernelSpec, OpDefinition, capabilities_satisfied,
)
from autosel.version import __version__

__all__ = [
    "CapabilityRequirement",
    "DeviceType",
    "FormatSignature",
    "KernelBackend",
    "KernelRegistry",
    "KernelSpec",
    "OpDefinition",
    "PlatformInfo",
    "by_tokens",
    "capabilities_satisfied",
    "clear_cache",
    "get_kernel",
    "register_kernel",
    "register_op",
    "registry",
    "select_kernel",
]
