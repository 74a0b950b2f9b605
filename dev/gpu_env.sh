# Source on a GPU machine (device tool, carry [".whl", ".gpu"], plus ".hfw" for transformers 5.24) from the repo
# root: . dev/gpu_env.sh
# Installs what the GPU image lacks and autosel itself, and exports PYTHONPATH and AUTOSEL_DB.
# Pure-Python dependencies (sqlite-utils and friends) travel in .whl, downloaded here by:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .whl \
#       sqlite-utils==4.2.1 sqlite-fts4==1.0.3 click-default-group click==8.4.0 platformdirs==4.14.8
# flashinfer and sgl-kernel travel in .gpu, built by dev/fetch_gpu_packages.sh.
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/autosel-gpu}
# The image sets PYTHONDONTWRITEBYTECODE=1 and its torch has no bytecode, so every process compiled the Python
# source of torch, sympy, triton and flashinfer again: importing torch's compiler and flashinfer took 14-16 s
# instead of 5 s, and a warm tune 60.5 s instead of 55.5 s (measured on the H200, commit 90bab00). Keep bytecode
# in /tmp, as any environment whose packages were installed with their bytecode has it.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
# transformers 5.24 (tools/hf_check.py, autosel bench model, tests/gpu/test_transformers_paged_gpu.py; the image has
# 5.17), when carried in .hfw: made by dev/fetch_transformers.sh, a trimmed archive and the huggingface_hub wheel
# 5.24 needs (only the model folders autosel runs, so that it fits the 64 MiB carry beside .gpu and .whl).
if [ -d .hfw ]; then
  if compgen -G '.hfw/*.whl' > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .hfw/*.whl || return 1
  fi
  for archive in .hfw/*.tar.xz; do [ ! -f "$archive" ] || tar -xJf "$archive" -C /tmp/site || return 1; done
fi
export PYTHONPATH=/tmp/site
if [ -f .gpu/activate.sh ]; then . .gpu/activate.sh || return 1; fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
export AUTOSEL_DB=/tmp/autosel-user.db
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
python3 -c "import autosel.platforms as p; print(p.current_platform())" >> "$OUT/gpu.txt"
