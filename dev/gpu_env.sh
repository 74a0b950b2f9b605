# Source on a GPU machine (device tool, carry [".whl", ".gpu"]) from the repo root: . dev/gpu_env.sh
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
# transformers and its dependencies (tools/hf_check.py, autosel bench model), when carried in .hfw: downloaded here by
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --platform any \
#       -d .hfw transformers==5.24.0     (then remove numpy, filelock, fsspec, typing_extensions, click, hf_xet,
#       pygments, rich, markdown_it_py, mdurl: the image has them or `autosel bench model` does not need them,
#       and the carry limit is 64 MiB with the working tree and .gpu)
if [ -d .hfw ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .hfw/*.whl || return 1; fi
export PYTHONPATH=/tmp/site
if [ -f .gpu/activate.sh ]; then . .gpu/activate.sh || return 1; fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
export AUTOSEL_DB=/tmp/autosel-user.db
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
python3 -c "import autosel.platforms as p; print(p.current_platform())" >> "$OUT/gpu.txt"
