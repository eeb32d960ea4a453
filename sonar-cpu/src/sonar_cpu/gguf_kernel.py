"""Sonar's own C kernel for GGUF block products (Q4_0 / Q4_1 / Q8_0) with float32 activations.

``csrc/gguf_gemm.c`` is compiled at first use with the system C compiler (AVX2, FMA, F16C) into
a cache directory and loaded with ctypes (which releases the GIL). Where there is no compiler
or no AVX2, :func:`load` answers None, logging why once.

GGUF layers use it only with ``SONAR_CPU_GGUF_KERNEL=1`` (:func:`block_kernel`). It is off by
default: its thread pool and torch's OpenMP threads contend for the cores, and through the
engine on 2 cores the embedded model decoded at 30.8 tok/s with it against 50.4 without.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "gguf_gemm.c"
CACHE_ENV = "SONAR_CPU_KERNEL_CACHE"
SWITCH_ENV = "SONAR_CPU_GGUF_KERNEL"  # "1": GGUF layers run this kernel
TYPES = (2, 3, 8)  # Q4_0, Q4_1, Q8_0
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


def _build() -> ctypes.CDLL | None:
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        logger.info("GGUF C kernel off: the CPU lacks %s; GGUF products run in torch", ", ".join(sorted(missing)))
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        logger.info("GGUF C kernel off: no C compiler (gcc or cc) on PATH; GGUF products run in torch")
        return None
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sonar" / "cpu")
    target = cache / f"gguf_gemm-{digest}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        command = [compiler, "-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-lpthread"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            logger.info("GGUF C kernel off: %s failed (%s); GGUF products run in torch", compiler, result.stderr.strip()[:200])
            return None
        partial.replace(target)
    library = ctypes.CDLL(str(target))
    library.gguf_linear.restype = ctypes.c_int
    library.gguf_linear.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    return library


def load() -> ctypes.CDLL | None:
    """The compiled kernel, built once per process (None where it cannot run here)."""
    global _library, _tried
    if not _tried:
        _tried = True
        _library = _build()
    return _library


def gguf_linear(x: torch.Tensor, ggml_type: int, data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x [..., cols] @ w.T`` for ``w`` the ``[rows, cols]`` GGUF blocks ``data`` (uint8, as stored),
    in float32. Needs :func:`load` to have answered a library."""
    library = load()
    flat = x.reshape(-1, cols).to(torch.float32).contiguous()
    out = torch.empty(flat.shape[0], rows, dtype=torch.float32)
    code = library.gguf_linear(ggml_type, data.data_ptr(), rows, cols, flat.data_ptr(), flat.shape[0], out.data_ptr(),
                               torch.get_num_threads())
    if code:
        raise ValueError(f"the GGUF C kernel takes Q4_0/Q4_1/Q8_0 with columns a multiple of 32, not type {ggml_type} x {cols}")
    return out.to(x.dtype).reshape(*x.shape[:-1], rows)


def block_kernel(ggml_type: int):
    """``gguf_linear`` for blocks of ``ggml_type`` where the kernel runs here, else None
    (the ``gguf_block_kernel`` operation of ``sonar.ops``)."""
    if os.environ.get(SWITCH_ENV, "0") != "1" or ggml_type not in TYPES or load() is None:
        return None
    return lambda x, data, rows, cols: gguf_linear(x, ggml_type, data, rows, cols)
