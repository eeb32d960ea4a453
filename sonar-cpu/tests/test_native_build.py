"""The C kernels built for the AVX2 baseline (no VNNI, no AVX-512) pass the kernel tests too,
whatever this host's own instruction set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sonar_cpu import native

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler or no AVX2/FMA/F16C here")


def test_the_avx2_baseline_build(tmp_path: Path) -> None:
    here = Path(__file__).parent
    env = {**os.environ, native.ISA_ENV: "avx2", native.CACHE_ENV: str(tmp_path)}
    tests = [str(here / name) for name in ("test_gguf_kernel.py", "test_cpu_ops.py", "test_cpu_attention.py")]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, "-k", "not fp16 and not half"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert [p.name for p in tmp_path.glob("*.so")] and all(p.name.endswith("-mavx2.so") for p in tmp_path.glob("*.so"))
