#!/usr/bin/env bash
# Idempotent set-up of everything mcallreduce needs on a Debian machine:
#   Open MPI (Debian packages) -> .venv -> torch 2.13.0 (CPU) + numpy + mpi4py built
#   against that MPI -> the package itself (editable, its compiled MPI executor built with
#   the same mpicc).
# A second run with unchanged inputs does nothing: a stamp file records what was done.
#   -> Horovod 0.28.1 built once against that torch (scripts/build_horovod.sh, cached wheel).
# Usage: scripts/setup_env.sh [--without-horovod]   (the allreduce and data benchmarks need no Horovod)
set -euo pipefail
with_horovod=1
case "${1:-}" in
  "") ;;
  --without-horovod) with_horovod=0 ;;
  *) echo "usage: $0 [--without-horovod]" >&2; exit 2 ;;
esac
repo=$(cd "$(dirname "$0")/.." && pwd)
venv="$repo/.venv"
py="$venv/bin/python"
say() { printf '[setup] %s\n' "$*" >&2; }

# 1. System packages: Open MPI (never a pip-installed MPI: mpi4py and Horovod must link
#    the system one); iproute2 and util-linux for the emulated cluster (ip, tc, unshare);
#    mount and e2fsprogs for the data bench's throttled loop disk; a C compiler and
#    libjpeg-turbo's headers for the optional crop-box JPEG decoder
#    (mcallreduce/data/_jpegroi.c; without them the package builds and uses simplejpeg).
#    tests/test_setup_script.py checks that every command the project runs is checked here.
need=()
{ command -v mpicc && command -v mpirun; } >/dev/null 2>&1 || need+=(openmpi-bin libopenmpi-dev)
{ command -v ip && command -v tc; } >/dev/null 2>&1 || need+=(iproute2)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
{ command -v losetup && command -v mount && command -v umount; } >/dev/null 2>&1 || need+=(mount)
command -v mkfs.ext4 >/dev/null 2>&1 || need+=(e2fsprogs)
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v g++ >/dev/null 2>&1 || need+=(g++)      # Horovod builds C++17 with CMake
command -v cmake >/dev/null 2>&1 || need+=(cmake)
[ -f /usr/include/jpeglib.h ] || need+=(libjpeg62-turbo-dev)
[ -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)/Python.h" ] || need+=(python3-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    say "installing from Debian's packages: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
  elif ! command -v mpicc >/dev/null 2>&1; then
    echo "mcallreduce needs an MPI with mpicc on PATH. As root run:" >&2
    echo "  apt-get install ${need[*]}" >&2
    exit 2
  else
    say "packages missing, install them as root (the emulated cluster, Horovod's build, the JPEG crop decoder): ${need[*]}"
  fi
fi

# 2. The virtual environment (ignored by git).
stamp="$venv/.mcallreduce-setup"
# (the C sources too: the editable install compiles them in place)
want=$(cat "$repo/scripts/setup_env.sh" "$repo/setup.py" "$repo"/scripts/requirements-*.txt "$repo"/mcallreduce/data/*.c \
       "$repo"/mcallreduce/native/*.[ch] 2>/dev/null | sha256sum | cut -c1-16)
# the JPEG extension counts as installed too where it can be built (a deleted .so is rebuilt)
modules='"mcallreduce", "mcallreduce._executor", "mpi4py", "torch"'
[ -f /usr/include/jpeglib.h ] && command -v cc >/dev/null 2>&1 && modules="$modules, \"mcallreduce.data._jpegroi\""
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$py" -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ($modules))))" 2>/dev/null; then
  # Python side already set up with these exact inputs: only Horovod and its hook to check.
  [ "$with_horovod" = 1 ] || exit 0
  "$repo/scripts/build_horovod.sh"
  exec "$py" -m mcallreduce.horovod.startup install
fi
if [ ! -x "$py" ]; then
  say "creating $venv"
  python3 -m venv "$venv"
fi
pip=("$py" -m pip install --disable-pip-version-check -q)

have() { "$py" - "$1" "$2" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version(sys.argv[1]).split('+')[0] == sys.argv[2] else 1)
PY
}

# 3. torch: the CPU build of 2.13.0 that lies on this disk (2.14 and CUDA builds break Horovod).
have torch 2.13.0 || { say "installing torch 2.13.0 (CPU)"; "${pip[@]}" torch==2.13.0; }
# 4. mpi4py compiled from source against the MPI on PATH (same libmpi as Horovod).
# mpi4py must link the very libmpi that mpicc builds against (Horovod links that one too).
same_mpi() {
  local linked system
  linked=$("$py" -c 'import mpi4py.MPI as M, os; print(os.path.realpath(M.__file__))' 2>/dev/null) || return 1
  linked=$(ldd "$linked" | awk '/libmpi\.so/ {print $3}' | xargs -r readlink -f)
  system=$(for d in $(mpicc --showme:libdirs); do readlink -f "$d/libmpi.so"; done 2>/dev/null | head -1)
  [ -n "$linked" ] && [ "$linked" = "$system" ]
}
if ! same_mpi; then
  say "building mpi4py against $(command -v mpicc)"
  MPICC=$(command -v mpicc) "${pip[@]}" --no-binary mpi4py --no-cache-dir --force-reinstall --no-deps "mpi4py>=4.0,<5"
fi
# 5. Everything else, and the package itself (editable, no dependency resolution surprises).
"${pip[@]}" "numpy>=1.24,<3" "pytest>=7" "matplotlib>=3.7" "setuptools>=61" wheel packaging
# Per-area extras (data loading, cluster, ...): one requirements file per area.
for req in "$repo"/scripts/requirements-*.txt; do
  [ -f "$req" ] && "${pip[@]}" -r "$req"
done
"${pip[@]}" --no-deps --no-build-isolation -e "$repo"
echo "$want" > "$stamp"
if [ "$with_horovod" = 0 ]; then
  say "environment ready (without Horovod): $venv"
  exit 0
fi
# 6. Horovod 0.28.1, patched to build against torch 2.13 (cached wheel; about 4 minutes once).
"$repo/scripts/build_horovod.sh"
# 7. The startup hook (a .pth file, inert unless MCALLREDUCE_ALGORITHM/MCALLREDUCE_HOROVOD is set).
"$py" -m mcallreduce.horovod.startup install
say "environment ready: $venv"
