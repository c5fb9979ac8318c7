#!/usr/bin/env bash
# Here, before a device run: the wheels of what xinfer, its tests and xinfer-bench import that the
# lent GPU machine's image lacks (its python3 is 3.12 with torch, triton and transformers), into
# .whl/ (git-ignored through .git/info/exclude; about 2.3 MB). bench/gpu_check.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
for pkg in msgspec pyzmq gguf setproctitle hypothesis-jsonschema jsonschema jsonschema-specifications referencing \
           rpds-py trio outcome sniffio; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$pkg"
done
du -sh .whl
