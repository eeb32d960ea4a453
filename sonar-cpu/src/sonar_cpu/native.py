"""Sonar's C kernels for the CPU (``csrc/*.c``), compiled at first use and loaded with ctypes.

The sources are compiled together with the system C compiler for this host's instruction set
(``-march=native``, else the AVX2 baseline; at least AVX2, FMA and F16C) into a cache directory
(``SONAR_CPU_KERNEL_CACHE``, else ``~/.cache/sonar/cpu``), keyed by the sources and the host's
CPU flags. ctypes releases the GIL for every call. Where there is no compiler or no AVX2,
:func:`load` answers None, logging why once, and callers run their torch paths.

The library is built with OpenMP and, loaded after torch, binds to torch's OpenMP runtime: its
parallel regions run on torch's intra-op threads, so the two never contend for the cores.
``SONAR_CPU_KERNELS=0`` turns every kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch  # noqa: F401  (loaded before the library, so that the library binds to torch's OpenMP runtime)

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
SWITCH_ENV = "SONAR_CPU_KERNELS"  # "0": no C kernels
CACHE_ENV = "SONAR_CPU_KERNEL_CACHE"
REQUIRED_FLAGS = {"avx2", "fma", "f16c"}
# fp-contract off: a product and a sum written apart round apart (explicit FMA intrinsics stay FMAs)
BASE_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
#: the instruction sets to compile for, best first: this host's own, then the AVX2 baseline
#: (``SONAR_CPU_KERNEL_ISA=avx2`` takes the baseline only, to check it on a newer host)
BASELINE = ["-mavx2", "-mfma", "-mf16c"]
TARGETS = (["-march=native"], BASELINE)
ISA_ENV = "SONAR_CPU_KERNEL_ISA"
_library: ctypes.CDLL | None = None
_tried = False


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sonar" / "cpu"
    return Path(root)


def _compile(compiler: str, target: Path, flags: list[str]) -> str | None:
    """Compile to ``target``; the compiler's complaint where it failed."""
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    result = subprocess.run([compiler, *BASE_FLAGS, *flags, "-o", str(partial), *map(str, SOURCES), "-lm"], capture_output=True, text=True)
    if result.returncode:
        partial.unlink(missing_ok=True)
        return result.stderr.strip()[:300] or f"exit status {result.returncode}"
    partial.replace(target)
    return None


def _build() -> ctypes.CDLL | None:
    if os.environ.get(SWITCH_ENV, "1") == "0":
        logger.info("CPU C kernels off (%s=0); torch runs every operation", SWITCH_ENV)
        return None
    cpu_flags = _cpu_flags()
    missing = REQUIRED_FLAGS - cpu_flags
    if missing:
        logger.info("CPU C kernels off: the CPU lacks %s; torch runs every operation", ", ".join(sorted(missing)))
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        logger.info("CPU C kernels off: no C compiler (gcc or cc) on PATH; torch runs every operation")
        return None
    # the build depends on the source and on the instruction sets of the host it targets
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS)) + " ".join(sorted(cpu_flags)).encode()).hexdigest()[:16]
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    complaint = None
    for flags in (BASELINE,) if os.environ.get(ISA_ENV) == "avx2" else TARGETS:
        target = cache / f"sonar_cpu-{digest}-{flags[0].lstrip('-').replace('=', '-')}.so"
        if target.exists() or (complaint := _compile(compiler, target, flags)) is None:
            return _bind(ctypes.CDLL(str(target)))
    logger.info("CPU C kernels off: %s failed (%s); torch runs every operation", compiler, complaint)
    return None


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    pointer, size, integer = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for product in (library.gguf_linear, library.gguf_linear_q8):
        product.restype = integer
        product.argtypes = [integer, pointer, integer, size, size, pointer, size, pointer, integer, pointer]
    library.gguf_linear_q8_experts.restype = integer
    library.gguf_linear_q8_experts.argtypes = [integer, pointer, integer, pointer, size, size, pointer, pointer, integer, pointer]
    library.gguf_q8_scratch_bytes.restype = size
    library.gguf_q8_scratch_bytes.argtypes = [size, size]
    library.gguf_k_linear.restype = integer
    library.gguf_k_linear.argtypes = [integer, pointer, size, size, pointer, size, pointer, integer, pointer, integer]
    library.gguf_k_linear_experts.restype = integer
    library.gguf_k_linear_experts.argtypes = [integer, pointer, integer, pointer, size, size, pointer, pointer, integer, pointer]
    library.gguf_k_scratch_bytes.restype = size
    library.gguf_k_scratch_bytes.argtypes = [size, size]
    library.paged_decode_attention.restype = integer
    library.paged_decode_attention.argtypes = [
        pointer, pointer, size, integer, integer, integer, integer, pointer, size, pointer, size, integer, ctypes.c_float,
        ctypes.c_float, pointer, integer,
    ]
    library.add_rms_norm.restype = None
    library.add_rms_norm.argtypes = [pointer, pointer, pointer, pointer, size, size, ctypes.c_float, integer]
    library.rotary_neox.restype = None
    library.rotary_neox.argtypes = [pointer, size, integer, pointer, size, integer, integer, integer, pointer, pointer, size]
    library.silu_and_mul.restype = None
    library.silu_and_mul.argtypes = [pointer, pointer, size, size, integer]
    library.write_kv.restype = None
    library.write_kv.argtypes = [pointer, size, pointer, size, pointer, size, size, pointer, size]
    library.argmax_rows.restype = None
    library.argmax_rows.argtypes = [pointer, size, size, pointer, integer]
    return library


def load() -> ctypes.CDLL | None:
    """The compiled kernels, built once per process (None where they cannot run here or are
    switched off)."""
    global _library, _tried
    if not _tried:
        _tried = True
        _library = _build()
    return _library
