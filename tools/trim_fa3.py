"""Shrink sglang-kernel's FlashAttention-3 library (sgl_kernel/flash_ops.abi3.so, 1.12 GB) to what autosel's
attention.decode / attention.extend call on Hopper, so that it travels to the GPU machine (docs/GPU_BACKENDS.md).

The library's `.nv_fatbin` section (1.03 GB) holds one fatbin per compiled source file of FA3, each with three
cubins: sm_90a, sm_80 and sm_86. This tool keeps the file's layout byte for byte and only overwrites with zeros
(so xz packs them into almost nothing):
- every sm_80 and sm_86 cubin (an H100/H200 loads the sm_90a one);
- every cubin of the source files not kept: head dims other than KEEP_HEAD_DIMS, fp8, the 64x512 MLA shapes,
  softcap, and the sm_80 builds.
CUDA loads a fatbin's module lazily, at the first launch of one of its kernels (CUDA_MODULE_LOADING=LAZY, the default
since CUDA 12.2), so the zeroed modules are never parsed unless such a kernel is launched, and such a launch fails
with a CUDA error, never a wrong result. autosel.ops.attention_fa3.supports makes those cases ineligible first.

    python3 tools/trim_fa3.py flash_ops.abi3.so flash_ops.trimmed.so
"""

from __future__ import annotations

import argparse
import mmap
import re
import shutil
import struct
import subprocess
import sys

FATBIN_MAGIC = 0xBA55ED50
SM90 = 90
KEEP_HEAD_DIMS = (64, 128, 256)
KEEP_DTYPES = ("bf16", "fp16")
# paged (page size not a multiple of the kernel's KV tile), split KV, and the TMA/plain and packed-GQA variants the
# dispatcher picks for the other cases; never softcap (autosel passes none).
_KEEP = re.compile(r"^flash_fwd_hdim(%s)_(%s)(_paged)?(_split)?(_packgqa)?_sm90$" % (
    "|".join(map(str, KEEP_HEAD_DIMS)), "|".join(KEEP_DTYPES)))
# The scheduler's prepare kernel and the split-KV combine kernel serve every kept file.
_SHARED = ("flash_fwd_combine", "flash_prepare_scheduler")
_SOURCE = re.compile(rb"_INTERNAL_[0-9a-f]+_\d+_(\w+?)_cu_[0-9a-f]+_")


def section(data, name: bytes) -> tuple[int, int]:
    """(file offset, size) of an ELF64 section."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    str_off, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        hdr = shoff + i * shentsize
        name_at, = struct.unpack_from("<I", data, hdr)
        end = data.find(b"\0", str_off + name_at)
        if data[str_off + name_at:end] == name:
            offset, size = struct.unpack_from("<QQ", data, hdr + 0x18)
            return offset, size
    raise ValueError(f"no section {name!r}: is this sgl_kernel's flash_ops library?")


def fatbins(data, start: int, size: int):
    """Yield (offset, entries) per fatbin; each entry is (payload offset, payload size, sm)."""
    pos = start
    while pos < start + size:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # alignment padding between fatbins
            pos += 8
            continue
        entries, e = [], pos + header_size
        while e < pos + header_size + fat_size:
            _kind, _flags, entry_header, payload = struct.unpack_from("<HHIQ", data, e)
            sm, = struct.unpack_from("<I", data, e + 28)
            entries.append((e + entry_header, payload, sm))
            e += entry_header + payload
        yield pos, entries
        pos += header_size + fat_size


def source_of(data, entries) -> str:
    """The FA3 source file a fatbin was compiled from, read from its cubins' internal symbol names."""
    for at, size, _sm in entries:
        payload = bytes(data[at:at + size])
        if payload[:4] != b"\x7fELF":  # a zstd-compressed cubin
            # zstd exits 1 on the zero padding after the frame; what it decoded before that is the cubin.
            payload = subprocess.run(["zstd", "-d", "-c"], input=payload, capture_output=True).stdout
        found = _SOURCE.search(payload)
        if found:
            return found.group(1).decode()
    return "?"


def keep(source: str) -> bool:
    return bool(_KEEP.match(source)) or source in _SHARED or source == "?"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args(argv)
    shutil.copyfile(args.src, args.dst)
    kept = zeroed = 0
    with open(args.dst, "r+b") as f, mmap.mmap(f.fileno(), 0) as data:
        start, size = section(data, b".nv_fatbin")
        for _pos, entries in fatbins(data, start, size):
            whole = keep(source_of(data, entries))
            for at, length, sm in entries:
                if whole and sm == SM90:
                    kept += length
                    continue
                data[at:at + length] = bytes(length)
                zeroed += length
        data.flush()
    print(f"kept {kept / 1e6:.1f} MB of sm_90a cubins, zeroed {zeroed / 1e6:.1f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
