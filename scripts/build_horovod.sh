#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 for the venv's torch (2.13.0, CPU): the MPI controller,
# with Gloo built in (HOROVOD_CPU_OPERATIONS=gloo: stock Horovod's ring allreduce on CPU).
#
# Why a script: 0.28.1 is Horovod's last release and compiles its torch extension as C++14,
# while torch >= 2.1 headers need C++17. We patch the two `set(CMAKE_CXX_STANDARD 14)` lines
# to 17 (nothing else), build a wheel without build isolation (so the build sees the venv's
# torch) and cache it in .cache/wheels/torch-<version>-mpi-gloo/ (a different torch, or other
# controllers, need a new binary). Idempotent: a cached wheel is never rebuilt, an installed one never reinstalled.
# About 5 minutes on 2 cores the first time, a second or two afterwards.
# Usage: scripts/build_horovod.sh     (after scripts/setup_env.sh)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv="$repo/.venv"
py="$venv/bin/python"
version=0.28.1
say() { printf '[horovod] %s\n' "$*" >&2; }

[ -x "$py" ] || { say "no $py: run scripts/setup_env.sh first"; exit 2; }
# Versions from package metadata: importing torch or horovod takes seconds on a busy machine.
pkg_version() { "$py" -c 'import sys; from importlib.metadata import version; print(version(sys.argv[1]))' "$1" 2>/dev/null; }
torch_version=$(pkg_version torch) || { say "no torch in the venv: run scripts/setup_env.sh first"; exit 2; }
torch_version=${torch_version%%+*}
cache="$repo/.cache/wheels/torch-$torch_version-mpi-gloo"
marker="$venv/.horovod-wheel"     # sha256 of the wheel installed in this venv

wheel=$(ls "$cache"/horovod-$version-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  command -v mpicc >/dev/null || { say "no mpicc on PATH (apt-get install libopenmpi-dev)"; exit 2; }
  command -v cmake >/dev/null || { say "no cmake on PATH (apt-get install cmake)"; exit 2; }
  command -v g++ >/dev/null || { say "no g++ on PATH (apt-get install g++)"; exit 2; }
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  say "building Horovod $version for torch $torch_version, MPI and Gloo (about 5 minutes on 2 cores)"
  "$py" -m pip install --disable-pip-version-check -q packaging setuptools wheel
  "$py" -m pip download --disable-pip-version-check -q --no-binary :all: --no-deps \
      "horovod==$version" -d "$work" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  [ -f "$work/horovod-$version.tar.gz" ] || { say "could not download the horovod==$version sdist"; exit 1; }
  tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
  src="$work/horovod-$version"
  for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || { say "unexpected $f: no C++14 line to patch"; exit 1; }
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
  done
  # CMAKE_POLICY_VERSION_MINIMUM: a pip-installed cmake 4.x rejects Horovod's old
  # cmake_minimum_required without it (Debian's 3.25 ignores it). MAKEFLAGS replaces
  # Horovod's default -j8, which oversubscribes small machines.
  CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
  HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI \
  MAKEFLAGS="-j$(nproc)" \
    "$py" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps \
      -w "$work/out" "$src" > "$work/build.log" 2>&1 || {
        tail -40 "$work/build.log" >&2; say "build failed (last lines of the log above)"; exit 1; }
  mkdir -p "$cache"
  built=$(ls "$work"/out/horovod-*.whl)
  mv "$built" "$cache/"
  wheel="$cache/$(basename "$built")"
  say "cached $wheel"
else
  say "using cached $wheel"
fi

sha=$(sha256sum "$wheel" | cut -c1-64)
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$sha" ] && [ "$(pkg_version horovod)" = "$version" ]; then
  say "Horovod $version already installed from that wheel"
  exit 0
fi
say "installing $(basename "$wheel")"
# Horovod's own dependencies (its wheel metadata: cloudpickle, psutil, pyyaml, packaging, cffi).
"$py" -m pip install --disable-pip-version-check -q --force-reinstall --no-deps "$wheel"
"$py" -m pip install --disable-pip-version-check -q cloudpickle psutil pyyaml packaging "cffi>=1.4"

# The build is only usable here if Horovod reports PyTorch, MPI and Gloo.
check=$("$venv/bin/horovodrun" --check-build)
if echo "$check" | grep -q '\[X\] PyTorch' && echo "$check" | grep -q '\[X\] MPI' &&
   echo "$check" | grep -q '\[X\] Gloo'; then
  echo "$sha" > "$marker"
  say "ready: horovodrun --check-build lists PyTorch, MPI and Gloo"
else
  echo "$check" >&2; say "horovodrun --check-build does not list PyTorch, MPI and Gloo"; exit 1
fi
