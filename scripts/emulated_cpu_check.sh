#!/usr/bin/env bash
# Run vitkit's compiled-operator tests on an emulated CPU without AVX-512, VNNI or AMX (an AVX2-only x86-64),
# on any x86-64 Linux machine:
#
#   bash scripts/emulated_cpu_check.sh                       # the operator tests
#   bash scripts/emulated_cpu_check.sh tests/test_kernels.py  # any pytest arguments
#   QEMU_CPU=Haswell bash scripts/emulated_cpu_check.sh      # another emulated CPU model
#
# Python runs under qemu-x86_64 (Debian: `apt install qemu-user`), whose CPU model `max` (the default here)
# has AVX2 and FMA but no AVX-512: PyTorch, oneDNN, fbgemm and vitkit's operators then take their AVX2
# paths, as on an AVX2-only EPYC. vitkit reads the CPU's features from /proc/cpuinfo, which qemu passes
# through from the host, so the tests see a copy without the AVX-512, VNNI and AMX flags, bind-mounted over it
# in a mount namespace of their own (unshare: root, or user namespaces).
#
# torch.compile's generated C++ is compiled by the host's compiler (a child process, not emulated), by default
# for the host CPU (-march=native): here it is compiled for x86-64-v3 (AVX2) into a fresh cache instead.
#
# The operators are compiled first, natively: their build flags do not depend on the CPU (the AVX-512 and
# AVX2 code paths are chosen at run time), so this is the library an AVX2-only machine builds, and compiling
# under emulation would take many minutes. Emulation is slow: about half a minute to import torch, and the
# default tests take about 20 minutes (17.7 on an Intel Xeon host, 2026-12-03).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
export QEMU_CPU=${QEMU_CPU:-max}
if ! command -v qemu-x86_64 >/dev/null; then
    echo "qemu-x86_64 not found: install qemu-user (Debian: apt install qemu-user)" >&2
    exit 2
fi
if [ "$(uname -m)" != x86_64 ]; then
    echo "this check emulates an x86-64 CPU on an x86-64 host; this machine is $(uname -m)" >&2
    exit 2
fi
[ $# -gt 0 ] || set -- tests/test_kernels.py tests/test_qkv_attention.py tests/test_autotune.py

"$PY" -c "
from vitkit.cpu.build import attention_available, int8_block_available
import sys
built = {'attention': attention_available(), 'int8_block': int8_block_available()}
print('operators built natively:', built)
sys.exit(0 if all(built.values()) else 1)
"

cpuinfo=$(mktemp)
inductor_cache=$(mktemp -d)
trap 'rm -rf "$cpuinfo" "$inductor_cache"' EXIT
export TORCHINDUCTOR_CPP_MARCH=x86-64-v3 TORCHINDUCTOR_CACHE_DIR=$inductor_cache
sed -E '/^flags/ s/ (avx512[a-z0-9_]*|amx_[a-z0-9_]*|avx_vnni[a-z0-9_]*|avx_ifma)\b//g' /proc/cpuinfo > "$cpuinfo"

if [ "$(id -u)" = 0 ]; then ns=(unshare --mount); else ns=(unshare --map-root-user --mount); fi
# shellcheck disable=SC2016
"${ns[@]}" bash -c '
set -euo pipefail
mount --bind "$1" /proc/cpuinfo
shift
py=$1
shift
qemu-x86_64 "$py" -c "
import torch
from vitkit.cpu.hardware import cpu_flags
capability = torch.backends.cpu.get_cpu_capability()
print(\"emulated CPU (QEMU_CPU=$QEMU_CPU): PyTorch capability\", capability, \"; AVX-512 flags seen by vitkit:\",
      sorted(f for f in cpu_flags() if f.startswith((\"avx512\", \"amx\"))) or \"none\")
assert capability == \"AVX2\", capability
"
exec qemu-x86_64 "$py" -m pytest -q -p no:cacheprovider -rs "$@"
' check "$cpuinfo" "$PY" "$@"
