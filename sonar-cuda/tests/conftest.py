"""Kernel tests run on the GPU where one is present, else on CPU tensors through Triton's
interpreter (``TRITON_INTERPRET=1``, set here before anything imports Triton)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before sonar-cuda's conftest could set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"


def _interpreter_index_fix() -> None:
    """Triton 3.6's interpreter turns 1-element arrays into loop bounds with ``int(array)``,
    which numpy >= 2.4 refuses (triton-lang/triton#9171, fixed after 3.6); take the element."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_index_fix(tensor: type, scope: object) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_tensor_with_index_fix


if not HAS_CUDA:
    _interpreter_index_fix()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU (skipped, with a reason, where none is present)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU: large-shape kernel tests run only on a GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _prompts_eager_in_the_interpreter(monkeypatch) -> None:
    """Without a GPU, prompts are prefilled eagerly: through the interpreter a prompt's rows in
    the decode kernel cost several times the prefill kernel (``test_cuda_prompt_rows`` turns
    them back on)."""
    if not HAS_CUDA:
        from sonar_cuda.model_runner import CudaModelRunner

        monkeypatch.setattr(CudaModelRunner, "prompt_chunk_limit", 0)


@pytest.fixture
def device() -> torch.device:
    """The GPU where present, else the CPU (kernels then run in Triton's interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
