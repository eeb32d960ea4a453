"""FP8 rows from the norm: in an FP8 model the norms before the q/k/v and gate/up projections
quantize their output per token in their own launch (steps of two tokens and more) and hand it
to the projection, which then skips its quantization launch. The engine gives the same tokens
and log-probabilities, bit for bit, with the hand-over and without it (the norm's rows are the
ones the product would make), on the CPU through Triton's interpreter. On a GPU the norm's two
specializations may sum the squares in another order, a last-bit difference that FP8 rounding
can amplify, so there the fused path is held to transformers instead
(``tests/test_quant_cuda.py``, which runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import InterpretedCudaPlatform, random_prompts, run_to_end

from sonar import ops
from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine
from sonar.sampling_params import SamplingParams
from sonar_models.testing import build_tiny_model

HAS_CUDA = torch.cuda.is_available()
FUSED_OPS = ("rms_norm_fp8_rows", "fused_add_rms_norm_fp8_rows")


class InterpretedCudaKernels(InterpretedCudaPlatform):
    """The CUDA platform's Triton kernels behind ``sonar.ops`` too (interpreted on CPU
    tensors), under the name the FP8 method runs on."""

    name = "cuda"
    ops_module = "sonar_cuda.ops"


def platform() -> type:
    from sonar_cuda.platform import CudaPlatform

    return CudaPlatform if HAS_CUDA else InterpretedCudaKernels


def run(path: Path, prompts: list[list[int]], fused: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list, int]:
    """Outputs of one engine, and how many products took rows from a norm."""
    from sonar_cuda import ops as cuda_ops

    device_type = "cuda" if HAS_CUDA else "cpu"
    handed = 0
    product = cuda_ops.OPS["fp8_linear"]

    def counting(*args):
        nonlocal handed
        handed += len(args) > 5 and args[5] is not None
        return product(*args)

    ops.unregister_ops(device_type)
    try:
        with monkeypatch.context() as patch:
            patch.setitem(cuda_ops.OPS, "fp8_linear", counting)
            if not fused:
                for name in FUSED_OPS:
                    patch.delitem(cuda_ops.OPS, name)
            engine = LLMEngine(
                EngineArgs(
                    model=str(path), quantization="fp8", dtype="bfloat16" if HAS_CUDA else "float32",
                    max_model_len=128, kv_cache_memory_bytes=8 << 20, enforce_eager=not HAS_CUDA,
                ),
                platform=platform(),
            )
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
            alone = run_to_end(engine, prompts[:1], [params])  # one row: the GEMV takes its own amax
            together = run_to_end(engine, prompts, [params] * len(prompts))  # the product reads the rows
            outputs = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]) for o in alone + together]
    finally:
        ops.unregister_ops(device_type)
    return outputs, handed


@pytest.mark.skipif(HAS_CUDA, reason="bit-for-bit only under the interpreter; tests/test_quant_cuda.py covers the GPU")
# Qwen3 is Llama plus norms over each head, which must not hand rows on: the one architecture
# covers both kinds of norm (under the interpreter each costs about half a minute)
@pytest.mark.parametrize("arch", ["qwen3"])
def test_norm_rows_give_the_same_outputs_as_the_product_quantizing(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = build_tiny_model(arch, tmp_path / arch)
    prompts = random_prompts(3, seed=5, min_len=3, max_len=12, vocab=1000)
    fused, handed = run(path, prompts, True, monkeypatch)
    plain, handed_plain = run(path, prompts, False, monkeypatch)
    assert handed > 0 and handed_plain == 0
    assert fused == plain
