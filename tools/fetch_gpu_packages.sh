#!/usr/bin/env bash
# Fetch flashinfer and sgl-kernel from PyPI and trim them into .gpu/ so they travel to the GPU machine.
#
# Run here (internet to PyPI, no GPU), from anywhere:   tools/fetch_gpu_packages.sh
# Then carry `.gpu` in the device `run` call and start the GPU command with this one-line preamble
# (run from the repo root; it installs into /tmp/site and puts that on PYTHONPATH):
#
#   . .gpu/activate.sh
#
# which is exactly:
#
#   mkdir -p /tmp/site && for t in .gpu/*.tar.xz; do tar -xJf "$t" -C /tmp/site; done && { [ ! -f .gpu/fi_aot.tar.gz ] || { mkdir -p /tmp/site/flashinfer/data/aot && tar -xzf .gpu/fi_aot.tar.gz -C /tmp/site/flashinfer/data/aot; }; } && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} FLASHINFER_USE_CUDA_NORM=1 FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
#
# What travels (see docs/GPU_BACKENDS.md for why each piece is needed and what was left out):
#   .gpu/flashinfer-0.7.4.tar.xz      flashinfer-python 0.7.4: every Python file, plus only the CUDA
#                                      sources/headers that the norm, rope, act_and_mul and paged
#                                      attention (batch decode, fa2 batch prefill) JIT modules include
#                                      (flashinfer compiles them with nvcc at first use).
#   .gpu/sglang_kernel-0.4.5.tar.xz   sglang-kernel 0.4.5 (the renamed sgl-kernel, built for torch 2.11
#                                      + CUDA 13): Python files + sm90/common_ops.abi3.so only.
#   .gpu/sgl_flash_ops-0.4.5.tar.xz   sglang-kernel 0.4.5's FlashAttention-3 library (flash_ops.abi3.so, 1.12 GB)
#                                      with every cubin autosel's attention does not call zeroed
#                                      (tools/trim_fa3.py): sm_90a, head_dim 64/128/256, bf16/fp16.
#   .gpu/whl/apache_tvm_ffi-*.whl     flashinfer's FFI runtime (compiled; not in the GPU image).
#   .gpu/sgl_kernel-0.3.21.undef.txt.gz  torch symbols the old sgl-kernel 0.3.21 needs (ABI evidence).
#   .gpu/fi_aot.tar.gz                 optional prebuilt flashinfer modules (see the preamble section).
#
# Idempotent: each output is built only if missing (delete .gpu/ to rebuild); downloads are cached
# outside the repo, in $GPU_PKG_CACHE (default /tmp/autosel-gpu-pkg-cache), so they never travel.
set -euo pipefail

FLASHINFER_VERSION=0.7.4
SGLANG_KERNEL_VERSION=0.4.5    # last sglang-kernel release pinned to torch==2.11.0
TVM_FFI_VERSION=0.1.15.post2
OLD_SGL_KERNEL_VERSION=0.3.21  # last "sgl-kernel" release (torch==2.9.1); only its symbol list travels

repo_root=$(cd "$(dirname "$0")/.." && pwd)
out="$repo_root/.gpu"
cache="${GPU_PKG_CACHE:-${TMPDIR:-/tmp}/autosel-gpu-pkg-cache}"
mkdir -p "$out/whl" "$cache"

pip_download() {
  # $1 = requirement; wheels for CPython 3.12 on x86-64 Linux, whatever this machine's Python is.
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$cache" "$1"
}

# --- flashinfer -----------------------------------------------------------------------------
fi_tar="$out/flashinfer-$FLASHINFER_VERSION.tar.xz"
if [ ! -s "$fi_tar" ]; then
  pip_download "flashinfer-python==$FLASHINFER_VERSION"
  work=$(mktemp -d)
  unzip -q "$cache/flashinfer_python-$FLASHINFER_VERSION-py3-none-any.whl" -d "$work"
  data="$work/flashinfer/data"
  # The include closure of the JIT sources autosel uses, found by following #include lines
  # (an over-approximation: it ignores #if, so it keeps more, never less).
  python3 - "$data" > "$work/keep.txt" <<'EOF'
import pathlib, re, sys
data = pathlib.Path(sys.argv[1]).resolve()
seeds = ["csrc/norm.cu", "csrc/flashinfer_norm_binding.cu", "csrc/rope.cu",
         "csrc/flashinfer_rope_binding.cu", "csrc/tvm_ffi_utils.h",
         "include/flashinfer/activation.cuh",  # act_and_mul .cu is generated; it includes this
         # attention: the paged decode module and the fa2 prefill module (autosel.ops.attention_flashinfer), whose
         # kernel files flashinfer renders from these templates at run time
         "csrc/batch_decode.cu", "csrc/batch_decode_jit_binding.cu", "csrc/batch_decode_customize_config.jinja",
         "csrc/batch_decode_kernel_inst.jinja", "csrc/batch_prefill.cu", "csrc/batch_prefill_jit_binding.cu",
         "csrc/batch_prefill_paged.cu", "csrc/batch_prefill_paged.cuh", "csrc/batch_prefill_paged_jit_binding.cu",
         "csrc/batch_prefill_customize_config.jinja", "csrc/batch_prefill_paged_kernel_inst.jinja",
         "csrc/batch_prefill_ragged_kernel_inst.jinja"]
dirs = [data / d for d in ("include", "csrc", "cutlass/include", "cutlass/tools/util/include",
                           "spdlog/include", "cccl/cub", "cccl/libcudacxx/include", "cccl/thrust")]
include = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
seen, todo = set(), [data / s for s in seeds]
while todo:
    f = todo.pop()
    if f in seen:
        continue
    seen.add(f)
    for name in include.findall(f.read_text(errors="replace")):
        for d in [f.parent] + dirs:
            if (d / name).is_file():
                todo.append((d / name).resolve())
                break
for f in sorted(seen):
    print(f.relative_to(data))
EOF
  # include, spdlog and the vendored CCCL stay whole; csrc and cutlass keep the closure only.
  # CCCL must stay whole: flashinfer puts it first on the include path (-I) to override the CUDA
  # toolkit's copy, and CUDA's own headers (cooperative_groups) include parts of it that the closure
  # above never sees; a partial copy mixes two CCCL versions and norm.cu fails with
  # "iosfwd:179: error: missing binary operator before token "("" (_LIBCUDACXX_HAS_WCHAR_H).
  keep_dir=$(mktemp -d)
  (cd "$data" && tar -cf - include spdlog cccl *.py $(grep -v '^cccl/' "$work/keep.txt")) \
    | tar -xf - -C "$keep_dir"
  rm -rf "$data" && mkdir -p "$data" && cp -a "$keep_dir"/. "$data"/ && rm -rf "$keep_dir"
  rm -f "$work"/flashinfer_python-*.dist-info/RECORD
  find "$work" -name __pycache__ -prune -exec rm -rf {} +
  (cd "$work" && tar -cf - flashinfer flashinfer_python-*.dist-info) | xz -T0 -6 > "$fi_tar.part"
  mv "$fi_tar.part" "$fi_tar"
  rm -rf "$work"
fi

# --- tvm-ffi (flashinfer's runtime; compiled, so it travels as a wheel) -------------------------
ls "$out"/whl/apache_tvm_ffi-"$TVM_FFI_VERSION"-*.whl >/dev/null 2>&1 || {
  pip_download "apache-tvm-ffi==$TVM_FFI_VERSION"
  cp "$cache"/apache_tvm_ffi-"$TVM_FFI_VERSION"-cp312-*.whl "$out/whl/"
}

# --- sglang-kernel (sgl_kernel) -----------------------------------------------------------------
sk_tar="$out/sglang_kernel-$SGLANG_KERNEL_VERSION.tar.xz"
if [ ! -s "$sk_tar" ]; then
  pip_download "sglang-kernel==$SGLANG_KERNEL_VERSION"
  work=$(mktemp -d)
  # Only the Python files and the Hopper build of the ops library: flash_ops.abi3.so alone is
  # over 1 GB, and sm100/ is for Blackwell.
  unzip -q "$cache"/sglang_kernel-"$SGLANG_KERNEL_VERSION"-*.whl 'sgl_kernel/*.py' \
    'sgl_kernel/sm90/*' 'sglang_kernel-*.dist-info/*' -d "$work"
  # RECORD lists files trimmed away. The wheel has no top_level.txt, and without RECORD importlib.metadata
  # cannot map the import name sgl_kernel to its distribution, so the version vector would miss it.
  rm -f "$work"/sglang_kernel-*.dist-info/RECORD
  echo sgl_kernel > "$(echo "$work"/sglang_kernel-*.dist-info)/top_level.txt"
  (cd "$work" && tar -cf - sgl_kernel sglang_kernel-*.dist-info) | xz -T0 -6 > "$sk_tar.part"
  mv "$sk_tar.part" "$sk_tar"
  rm -rf "$work"
fi

# --- sglang-kernel's FlashAttention-3 library, trimmed to the Hopper cubins autosel calls ----------------------
fa3_tar="$out/sgl_flash_ops-$SGLANG_KERNEL_VERSION.tar.xz"
if [ ! -s "$fa3_tar" ]; then
  work=$(mktemp -d)
  unzip -q "$cache"/sglang_kernel-"$SGLANG_KERNEL_VERSION"-*.whl 'sgl_kernel/flash_ops.abi3.so' -d "$work/full"
  mkdir -p "$work/sgl_kernel"
  python3 "$repo_root/tools/trim_fa3.py" "$work/full/sgl_kernel/flash_ops.abi3.so" "$work/sgl_kernel/flash_ops.abi3.so"
  (cd "$work" && tar -cf - sgl_kernel/flash_ops.abi3.so) | xz -T0 -6 > "$fa3_tar.part"
  mv "$fa3_tar.part" "$fa3_tar"
  rm -rf "$work"
fi

# --- old sgl-kernel: only the list of torch C++ symbols it imports, to show the ABI break -------
undef="$out/sgl_kernel-$OLD_SGL_KERNEL_VERSION.undef.txt.gz"
if [ ! -s "$undef" ]; then
  pip_download "sgl-kernel==$OLD_SGL_KERNEL_VERSION"
  work=$(mktemp -d)
  unzip -q "$cache/sgl_kernel-$OLD_SGL_KERNEL_VERSION-cp310-abi3-manylinux2014_x86_64.whl" \
    sgl_kernel/sm90/common_ops.abi3.so -d "$work"
  nm -D --undefined-only "$work/sgl_kernel/sm90/common_ops.abi3.so" | awk '{print $2}' \
    | grep -E '^_ZN?K?(3c10|2at|5torch)' | gzip -9 > "$undef"
  rm -rf "$work"
fi

# --- the preamble ------------------------------------------------------------------------------
# .gpu/fi_aot.tar.gz (optional, not made here): <module>/<module>.so files that flashinfer compiled
# on an H200 in an earlier run: `BENCH=heldout bash tools/gpu_run.sh` leaves them in $OUT/fi_aot.tar.gz; copy it
# here. Unpacked into flashinfer/data/aot/, flashinfer loads them as AOT modules and never calls nvcc (call 22-1's
# cold tune took 215 s without them, stop 20's 105-118 s with them: docs/H200.md).
cat > "$out/activate.sh" <<'EOF'
# Source from the repo root on the GPU machine: . .gpu/activate.sh
mkdir -p /tmp/site && for t in .gpu/*.tar.xz; do tar -xJf "$t" -C /tmp/site; done && { [ ! -f .gpu/fi_aot.tar.gz ] || { mkdir -p /tmp/site/flashinfer/data/aot && tar -xzf .gpu/fi_aot.tar.gz -C /tmp/site/flashinfer/data/aot; }; } && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} FLASHINFER_USE_CUDA_NORM=1 FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
EOF

ls -l "$out" "$out/whl"
echo "total to carry: $(du -sb "$out" | awk '{printf "%.1f MiB", $1/1048576}') in $out"
