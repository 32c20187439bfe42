"""The compiled CPU kernels: decode attention with K/V read in place (csrc/paged_decode.cpp,
with rotary and the K/V store fused), and the decoder's fused elementwise steps
(csrc/fused_ops.cpp: RMSNorm with the residual add before it, silu-and-mul), and the decode
step's linears (csrc/small_linear.cpp for a few rows, csrc/amx_linear.cpp on AMX tiles).

They are built as one library with the system C++ compiler against the installed torch
into the kvmesh cache, keyed on the sources, the torch version and the CPU's flags (it is
compiled with ``-march=native``), at ``make install``
(``python -m kvmesh.engine.model.paged_kernel``) or else at first use, and loaded as
``torch.ops.kvmesh.*``. Without a compiler (or without glibc's vector math library,
libmvec), or when it fails to build or load, ``available()`` is False with the reason in
one warning line, and the model runs its PyTorch ops as before (attention gathers the
blocks).
``KVMESH_PAGED_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from kvmesh.machine import cpu_has_amx
from kvmesh.native_build import build_from_sources

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = ["paged_decode.cpp", "fused_ops.cpp", "small_linear.cpp", "amx_linear.cpp", "vnni_linear.cpp", "f32_packed_linear.cpp", "prefill_attention.cpp"]  # in CSRC (or another csrc folder)
HEADERS = ["cpu_math.h"]
DISABLE_ENV = "KVMESH_PAGED_KERNEL"
FLAGS = ["-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-Wno-psabi"]

_state: bool | None = None  # None: not tried yet
last_failure = ""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def library_path(cache: Path | None = None, march: str = "native", csrc: Path = CSRC) -> Path:
    from kvmesh.engine.loader.default_model import cache_dir

    flags = " ".join([*FLAGS, f"-march={march}"])
    code = b"".join((csrc / name).read_bytes() for name in [*SOURCES, *HEADERS] if (csrc / name).exists())
    key = hashlib.sha256(code + torch.__version__.encode() + flags.encode() + _cpu_flags().encode()).hexdigest()[:16]
    return (cache or cache_dir()) / f"paged_decode-{key}.so"


def build(cache: Path | None = None, march: str = "native", csrc: Path = CSRC) -> Path | None:
    """The compiled kernel, built now if needed (atomically); None when it cannot be.
    ``march``: the instruction set it is compiled for (the tests also build ``x86-64-v3``,
    AVX2 without AVX-512, to check that path on a machine that has more); ``csrc``: the
    folder of the sources (benchmarks/kernel_ab_bench.py builds an earlier commit's)."""
    global last_failure
    path = library_path(cache, march, csrc)
    if path.exists():
        return path
    cxx = compiler()
    if cxx is None:
        last_failure = "no C++ compiler"
        return None
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libdirs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = [flag for flag in FLAGS if flag != "-shared"]
    last_failure = build_from_sources(
        path,
        lambda source, target: [cxx, *compile_flags, f"-march={march}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, "-c", str(source), "-o", str(target)],
        lambda objects, output: [
            cxx, "-shared", "-fopenmp", *map(str, objects), "-o", output,
            *[f"-L{d}" for d in libdirs], *[f"-Wl,-rpath,{d}" for d in libdirs], "-lc10", "-ltorch_cpu", "-lmvec",
        ],
        [csrc / name for name in SOURCES if (csrc / name).exists()],
        timeout=600,
    )  # fmt: skip
    if last_failure:
        return None
    return path


def prefill_attention_wanted(head_dim: int, group: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Does prefill attention of these heads (``group`` query heads a KV head) in ``dtype`` go to
    the compiled kernel (``csrc/prefill_attention.cpp``, built for 64 and 128 dims and groups of
    up to 8)? bfloat16 where it is built (AVX512-BF16) and float32 where it is built (AVX-512),
    on CPUs without AMX-BF16: there PyTorch's flash attention computes bfloat16 no faster than
    float32 (docs/benchmarks.md, "Issue 12 on an AMD EPYC Zen 4 without AMX"), and the kernel
    makes a float32 prefill 1.11-1.30x faster than flash attention does (docs/benchmarks.md, "A
    float32 prefill attention kernel, and both dtypes' kernel in tiles of rows"); with AMX flash
    attention is kept, not measured against it."""
    if head_dim not in (64, 128) or not 1 <= group <= 8 or dtype not in (torch.bfloat16, torch.float32):
        return False
    if not available() or not hasattr(torch.ops.kvmesh, "prefill_attention_lse"):  # an earlier commit's library
        return False  # (before 3fb611e the op took no earlier context and had no log-sum-exp variant)
    return prefill_attention_built(dtype) and not cpu_has_amx()


def prefill_attention_built(dtype: torch.dtype) -> bool:
    """Does the loaded library have the prefill attention kernel for ``dtype``?"""
    try:
        return bool(torch.ops.kvmesh.prefill_attention_built(str(dtype).removeprefix("torch.")))
    except RuntimeError:  # a library before the float32 kernel: its op takes no dtype (bfloat16 only)
        return dtype == torch.bfloat16 and bool(torch.ops.kvmesh.prefill_attention_built())


def available() -> bool:
    """Are the ``torch.ops.kvmesh`` kernels loaded (building and loading them on first call)?"""
    global _state, last_failure
    if _state is not None:
        return _state
    _state = False
    if os.environ.get(DISABLE_ENV, "1") == "0":
        last_failure = f"{DISABLE_ENV}=0"
        return False
    path = build()
    if path is not None:
        try:
            torch.ops.load_library(str(path))
            _state = True
            logger.info("compiled CPU kernels loaded (decode and prefill attention, fused norms, small-batch and AMX linears): %s", path.name)
        except (OSError, RuntimeError) as exc:
            last_failure = f"loading {path} failed: {exc}"
    if not _state:
        logger.warning("compiled decode attention unavailable (%s); gathering K/V blocks in PyTorch", last_failure)
    return _state


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build()
    print(built if built else f"paged_decode kernel not built: {last_failure}", file=sys.stderr)
