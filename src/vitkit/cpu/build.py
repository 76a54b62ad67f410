"""vitkit's compiled CPU operators: built from src/vitkit/cpu/csrc on first use, then loaded from the cache.

The libraries of operators:
- `torch.ops.vitkit.int8_block` (csrc/int8_block.cpp, csrc/block_region.h): a whole encoder block of the int8
  model as one parallel region, each thread through its own share of the tokens, with two meeting points
  between the threads per block instead of the fifteen or so of running the block operator by operator (see
  `vitkit.cpu.int8`);
  The same library has `int8_block_vnni`, that block on vitkit's own int8 products for AVX512-VNNI CPUs
  (csrc/int8_gemm.h), with `int8_vnni_pack` and `int8_vnni_linear`;
- `torch.ops.vitkit.attention_forward` and `attention_backward` (csrc/attention.cpp): fp32 self-attention read
  straight from the fused q;k;v projection and its gradient written straight into one (see
  `vitkit.cpu.attention`);
- `torch.ops.vitkit.gemm_pack` and `gemm_linear` (csrc/gemm.cpp): an fp32 linear layer on a packed weight for
  AVX2 CPUs, one of the engines `vitkit.optimize`'s layers time (see `vitkit.cpu.packed`);
- `torch.ops.vitkit.fp32_block` (csrc/fp32_block.cpp, csrc/fp32_gemm.h): a whole encoder block of the fp32
  model as one parallel region on vitkit's own AVX-512 products (csrc/fp32_gemm_avx2.h's on AVX2 CPUs), with
  `fp32_block_pack` (see
  `vitkit.cpu.fp32_block`);
- `torch.ops.vitkit.bf16_block` (csrc/bf16_block.cpp, csrc/bf16_gemm.h): the same for the bf16 model on CPUs
  with AVX512-BF16, with `bf16_block_pack` (see `vitkit.cpu.bf16_block`);
- `torch.ops.vitkit.peak_ops` (csrc/peak.cpp): the CPU's arithmetic limit per instruction, measured (see
  `vitkit.cpu.peak`).

`torch.utils.cpp_extension` compiles each with the machine's C++ compiler and ninja (a dependency of vitkit)
into torch's extension cache (`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions): 10-60 s a library
the first time (said on stderr), a fraction of a second afterwards. A library is named by the content of the
sources it is built from (and by torch's version and the build flags), which are copied into its folder of the
cache and built there: installations of the same vitkit (a reinstall, another virtual environment or checkout)
share one build, and a change to any source builds anew. Where that fails (no compiler, a read-only cache),
the library's `..._available()` function says why in one warning and returns False, and the callers keep to
plain PyTorch operators. `VITKIT_KERNELS=0` in the environment turns the compiled operators off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ..extras import available, install_hint
from .hardware import cpu_flags, cpu_has_native_bf16, cpu_isa, process_hold
from .private import extension_build_directory, extension_library_exists

CSRC = Path(__file__).with_name("csrc")
DISABLE_ENV = "VITKIT_KERNELS"


def kernels_enabled() -> bool:
    """False when the environment turns vitkit's compiled operators off (VITKIT_KERNELS=0, false, no, off)."""
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def cxx_compiler() -> str | None:
    """The C++ compiler torch builds CPU code with here (vitkit's operators through cpp_extension, and
    torch.compile's inductor kernels): $CXX, else c++, g++ or clang++ on PATH; None where there is none."""
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def _tool_path() -> str:
    """PATH with the directories of this Python's scripts and of the ninja package in front: cpp_extension
    calls `ninja` by name, and a virtual environment that is not activated does not have it on PATH."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    return os.pathsep.join([*dirs, os.environ.get("PATH", "")])


@contextlib.contextmanager
def _quiet_cpp_extension() -> Iterator[None]:
    """Importing cpp_extension on a machine without CUDA logs a warning about CUDA_HOME that concerns us not:
    its logger says errors only, meanwhile."""
    ext_log = logging.getLogger("torch.utils.cpp_extension")
    level = ext_log.level
    ext_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        ext_log.setLevel(level)


def _build(name: str, sources: Sequence[Path], flags: Sequence[str] = ()) -> None:
    """Compile `sources` into a library of torch operators and load it (registering its operators)."""
    path_before = os.environ.get("PATH")
    os.environ["PATH"] = _tool_path()
    try:
        from torch.utils.cpp_extension import load

        if not extension_library_exists(name):  # said once: it takes a while
            print(f"vitkit: compiling its CPU operators ({name}), once per installation: 10-60 s",
                  file=sys.stderr, flush=True)
        load(name=name, sources=[str(s) for s in sources], extra_cflags=["-O3", "-fopenmp", *flags],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    finally:
        if path_before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path_before


def build_operator(name: str, sources: Sequence[Path], op: str) -> bool:
    """Make `torch.ops.vitkit.<op>` available: True if it is registered already or once library `name`, built
    from `sources` (stage_sources), has registered it; else a RuntimeWarning that says why, and False."""
    if hasattr(torch.ops.vitkit, op):
        return True
    if cxx_compiler() is None:
        no_compiler()
        return False
    if not available("ninja") and shutil.which("ninja") is None:
        no_build_tool()
        return False
    hold = process_hold()  # a bad VITKIT_CPU_ISA is the user's error, not a failed build
    try:
        flags, suffix = [], ""
        if hold == "avx2":  # a library of its own, no AVX-512 code chosen at run time (cpu_hold.h)
            flags, suffix = ["-DVITKIT_HOLD_AVX2"], "_avx2"
        with _quiet_cpp_extension():  # staging and building both import cpp_extension
            library, staged = stage_sources(name, sources, flags, suffix)
            _build(library, staged, flags)
        if hasattr(torch.ops.vitkit, op):
            return True
        why = f"library {name} loaded without registering {op}"
    except Exception as e:
        # a missing compiler or ninja, a failed build: the callers' Python path still works
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[0] if lines else ''}"
    warnings.warn(f"vitkit: could not build the operator {op} ({why}); vitkit runs plain PyTorch operators "
                  f"instead (slower). {DISABLE_ENV}=0 turns vitkit's operators off.",
                  RuntimeWarning, stacklevel=2)
    return False


def source_files(sources: Sequence[Path]) -> list[Path]:
    """What a library is built from: every file of CSRC (a source includes headers by name from its own
    folder) and any source that lies elsewhere."""
    inside = sorted(p for p in CSRC.iterdir() if p.is_file()) if CSRC.is_dir() else []
    return [*inside, *(s for s in sources if s.parent.resolve() != CSRC.resolve())]


def stage_sources(name: str, sources: Sequence[Path], flags: Sequence[str], suffix: str = "",
                  ) -> tuple[str, list[Path]]:
    """The library's name, `name` and a digest of its files' names and bytes, torch's version and `flags`;
    and the paths of `sources` among copies of those files in the library's folder of the extension cache.
    Built from the copies, the library's build command is the same for every installation of these sources,
    so that none rebuilds another's (torch rebuilds a library whose command changed)."""
    files = source_files(sources)
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    digest.update(f"{torch.__version__}\0{' '.join(flags)}".encode())
    library = f"{name}_{digest.hexdigest()[:12]}{suffix}"
    folder = extension_build_directory(library) / "src"
    if not folder.is_dir():  # copied once: a later copy would be newer than the library and rebuild it
        partial = folder.with_name(f"src.{os.getpid()}.partial")
        partial.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(f, partial / f.name)
        try:
            os.rename(partial, folder)
        except OSError:  # another process (of a data-parallel run) put its copy there first
            shutil.rmtree(partial, ignore_errors=True)
    return library, [folder / s.name for s in sources]


@functools.cache
def no_compiler() -> None:
    """Say once per process that there is no C++ compiler to build the operators with (nothing is tried)."""
    warnings.warn("vitkit: no C++ compiler (install g++ or set CXX); the plain PyTorch path runs",
                  RuntimeWarning, stacklevel=3)


@functools.cache
def no_build_tool() -> None:
    """Say once per process that ninja, which builds the operators, is missing (nothing is tried)."""
    warnings.warn(f"vitkit: its compiled CPU operators need {install_hint('ninja')}; the plain PyTorch path "
                  "runs", RuntimeWarning, stacklevel=3)


@functools.cache
def _int8_block_built() -> bool:
    """The int8 block operator, built and loaded once per process (so a failure warns once)."""
    return build_operator("vitkit_int8_block", [CSRC / "int8_block.cpp"], "int8_block")


def int8_block_available() -> bool:
    """Whether `torch.ops.vitkit.int8_block` can be used here: a CPU build of torch with OpenMP and fbgemm,
    compiled operators not turned off, and the operator built (on the first call) and loaded."""
    if not kernels_enabled():
        return False
    if not (torch.backends.openmp.is_available() and "fbgemm" in torch.backends.quantized.supported_engines):
        return False
    return _int8_block_built()


def int8_vnni_available() -> bool:
    """Whether vitkit's own int8 products (`torch.ops.vitkit.int8_vnni_linear` and `int8_block_vnni`,
    csrc/int8_gemm.h) run here: the int8 block's library built, and a CPU with AVX512-VNNI and the AVX-512
    subsets they use (the library's own check, `int8_vnni_here`)."""
    return int8_block_available() and bool(torch.ops.vitkit.int8_vnni_here())


@functools.cache
def _fp32_block_built() -> bool:
    """The fp32 block operator, built and loaded once per process (so a failure warns once)."""
    return build_operator("vitkit_fp32_block", [CSRC / "fp32_block.cpp"], "fp32_block")


def fp32_block_available() -> bool:
    """Whether `torch.ops.vitkit.fp32_block` can be used here: a CPU build of torch with OpenMP, compiled
    operators not turned off, a CPU with AVX-512, or AVX2 and FMA (nothing is built elsewhere), and the
    library built (on the first call) and loaded."""
    return (kernels_enabled() and torch.backends.openmp.is_available()
            and (cpu_isa() == "avx512" or (cpu_isa() == "avx2" and "fma" in cpu_flags()))
            and _fp32_block_built() and bool(torch.ops.vitkit.fp32_block_here()))


@functools.cache
def _bf16_block_built() -> bool:
    """The bf16 block operator, built and loaded once per process (so a failure warns once)."""
    return build_operator("vitkit_bf16_block", [CSRC / "bf16_block.cpp"], "bf16_block")


def bf16_block_available() -> bool:
    """Whether `torch.ops.vitkit.bf16_block` can be used here: a CPU build of torch with OpenMP, compiled
    operators not turned off, a CPU with AVX512-BF16 (nothing is built elsewhere), and the library built (on
    the first call) and loaded."""
    return (kernels_enabled() and torch.backends.openmp.is_available() and cpu_isa() == "avx512"
            and "avx512_bf16" in cpu_flags() and _bf16_block_built()
            and bool(torch.ops.vitkit.bf16_block_here()))


@functools.cache
def _attention_built() -> bool:
    """The attention operators, built and loaded once per process (so a failure warns once)."""
    return build_operator("vitkit_attention", [CSRC / "attention.cpp"], "attention_forward_bf16")


def attention_available() -> bool:
    """Whether `torch.ops.vitkit.attention_forward` / `attention_backward` can be used here: compiled
    operators not turned off, and the library built (on the first call) and loaded."""
    return kernels_enabled() and _attention_built()


@functools.cache
def _layer_norm_bf16_built() -> bool:
    """The bf16 LayerNorm operator, built and loaded once per process (so a failure warns once)."""
    return build_operator("vitkit_layer_norm_bf16", [CSRC / "layer_norm_bf16.cpp"], "layer_norm_bf16")


def layer_norm_bf16_available() -> bool:
    """Whether `torch.ops.vitkit.layer_norm_bf16` can be used here: compiled operators not turned off, a CPU
    with native bf16 (nothing is built elsewhere), the library built (on the first call) and loaded, and
    AVX512-BF16 (its own check)."""
    return (kernels_enabled() and cpu_has_native_bf16() and _layer_norm_bf16_built()
            and bool(torch.ops.vitkit.layer_norm_bf16_here()))


@functools.cache
def _gemm_built() -> bool:
    """The fp32 product operators, built and loaded once per process (so a failure warns once)."""
    return build_operator("vitkit_gemm", [CSRC / "gemm.cpp"], "gemm_linear")


def gemm_available() -> bool:
    """Whether `torch.ops.vitkit.gemm_pack` / `gemm_linear` can be used here: a CPU with AVX2 and FMA but not
    AVX-512 (where oneDNN's AVX-512 products are at the CPU's limit already), compiled operators not turned
    off, and the library built (on the first call) and loaded."""
    return kernels_enabled() and cpu_isa() == "avx2" and "fma" in cpu_flags() and _gemm_built()


@functools.cache
def _peak_built() -> bool:
    """The peak probe, built and loaded once per process (so a failure warns once)."""
    return build_operator("vitkit_peak", [CSRC / "peak.cpp"], "peak_ops")


def peak_available() -> bool:
    """Whether `torch.ops.vitkit.peak_ops` can be used here: compiled operators not turned off, and the
    library built (on the first call) and loaded."""
    return kernels_enabled() and _peak_built()
