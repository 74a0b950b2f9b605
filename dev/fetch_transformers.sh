#!/usr/bin/env bash
# Fetch transformers 5.24.0 from PyPI and trim it into .hfw/ so that it travels to the GPU machine (whose image has
# transformers 5.17) beside .whl and .gpu, within the device's 64 MiB carry.
#
# Run here (internet to PyPI), from anywhere:   dev/fetch_transformers.sh
# Then carry `.hfw` too; dev/gpu_env.sh installs its wheels and unpacks its archive into /tmp/site.
#
# What travels:
#   .hfw/transformers-5.24.0-trimmed.tar.xz  transformers/ with only the model folders autosel runs (llama, mistral,
#       qwen2, qwen3: autosel.integrations.transformers.FAMILIES and `autosel bench model`'s models), auto, and gpt2
#       (the family tests/test_integrations_transformers.py shows refused); without the modular_*.py sources (inputs
#       of transformers' code generator, never imported) and bytecode; plus its dist-info less RECORD (which lists
#       the dropped files), so importlib.metadata reads 5.24.0.
#   .hfw/huggingface_hub-1.31.0-py3-none-any.whl  transformers 5.24 checks at import for huggingface-hub>=1.31.0,
#       where 5.17 accepts >=1.5.0, so an image made for 5.17 may have one too old. Its other install requirements
#       are 5.17's.
#
# Rebuilds .hfw from scratch (it holds nothing else); the downloads are cached outside the repo, in $HFW_CACHE
# (default /tmp/autosel-hfw-cache), so they never travel.
set -euo pipefail

TRANSFORMERS_VERSION=5.24.0
HUB_VERSION=1.31.0
KEEP_MODELS="auto llama mistral qwen2 qwen3 gpt2"
# The carry is 64 MiB; .whl, .gpu and the tracked files take all but about 5.5 MB of it.
MAX_BYTES=4500000

repo_root=$(cd "$(dirname "$0")/.." && pwd)
out="$repo_root/.hfw"
cache="${HFW_CACHE:-${TMPDIR:-/tmp}/autosel-hfw-cache}"
mkdir -p "$cache"
for requirement in "transformers==$TRANSFORMERS_VERSION" "huggingface_hub==$HUB_VERSION"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any -d "$cache" \
    "$requirement"
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unzip -q "$cache/transformers-$TRANSFORMERS_VERSION-py3-none-any.whl" -d "$work"
for model in "$work"/transformers/models/*/; do
  case " $KEEP_MODELS " in *" $(basename "$model") "*) ;; *) rm -r "$model" ;; esac
done
find "$work/transformers" \( -name '__pycache__' -prune -o -name '*.pyc' -o -name '*.pyi' -o -name 'modular_*.py' \) \
  -exec rm -rf {} +
rm "$work/transformers-$TRANSFORMERS_VERSION.dist-info/RECORD"

rm -rf "$out"
mkdir -p "$out"
tar -C "$work" -cf - transformers "transformers-$TRANSFORMERS_VERSION.dist-info" | xz -9e > \
  "$out/transformers-$TRANSFORMERS_VERSION-trimmed.tar.xz"
cp "$cache/huggingface_hub-$HUB_VERSION-py3-none-any.whl" "$out/"

size=$(du -sb "$out" | cut -f1)
echo "$out: $size bytes"
if [ "$size" -gt "$MAX_BYTES" ]; then
  echo "$out is over the $MAX_BYTES bytes the carry leaves beside .whl and .gpu: trim more here" >&2
  exit 1
fi
