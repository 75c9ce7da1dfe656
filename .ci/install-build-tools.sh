#!/usr/bin/env bash
# CI: the compilers and cmake that `make llamacpp` builds llama.cpp's tools with.
# Does nothing when they are already on PATH (the usual case on these machines).
set -euo pipefail
missing=0
for tool in cmake make cc c++; do
    command -v "$tool" >/dev/null 2>&1 || missing=1
done
[ "$missing" = 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "install-build-tools: cmake, make or a C/C++ compiler is missing; as root run" \
        "apt-get install cmake build-essential" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get -q -y install --no-install-recommends cmake build-essential >/dev/null ||
    { apt-get -q update >/dev/null && apt-get -q -y install --no-install-recommends cmake build-essential >/dev/null; }
