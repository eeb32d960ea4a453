"""Shared fixtures for cross-package tests: tiny random models and the transformers oracle."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("SONAR_PLATFORM", "cpu")


@pytest.fixture(scope="session", autouse=True)
def _gguf_name_maps_reused() -> None:
    """transformers' GGUF loader (an oracle here) builds the same name maps hundreds of times."""
    from sonar_models.testing import reuse_gguf_name_maps

    reuse_gguf_name_maps()

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    from sonar_models.testing import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(arch, root / arch)
        return built[arch]

    return get


PLUGIN_PACKAGES = Path(__file__).parent / "plugins"


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory):
    """``plugin_site(name)``: the test plugin package ``tests/plugins/<name>`` installed by pip
    into a folder of its own (once a session), not into the environment: a fresh process sees
    its entry points with the folder on ``PYTHONPATH`` (``with_site``), as it would see an
    installed package, and nothing else running from this environment ever does."""
    import subprocess
    import sys

    sites: dict[str, Path] = {}

    def install(name: str) -> Path:
        if name not in sites:
            site = tmp_path_factory.mktemp(f"site-{name}")
            build = tmp_path_factory.mktemp(f"build-{name}")
            # built from a copy: a build writes its metadata beside the sources
            source = Path(shutil.copytree(PLUGIN_PACKAGES / name, build / name))
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-compile", "--target", str(site), str(source)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            sites[name] = site
        return sites[name]

    return install


def with_site(env: dict[str, str] | os._Environ[str], *sites: Path) -> dict[str, str]:
    """``env`` with ``sites`` first on ``PYTHONPATH``."""
    paths = [*map(str, sites), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def site_has_entry_point(site: Path, name: str) -> bool:
    """Whether a package installed in ``site`` declares the ``sonar.plugins`` entry point ``name``."""
    import importlib.metadata

    return any(
        ep.group == "sonar.plugins" and ep.name == name for dist in importlib.metadata.distributions(path=[str(site)]) for ep in dist.entry_points
    )


def random_prompts(count: int, seed: int, min_len: int = 1, max_len: int = 90, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(100, vocab - 1) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


class HFOracle:
    """transformers on the same folder: greedy continuation and per-step log-probabilities."""

    def __init__(self, path: Path | str, gguf_file: str | None = None) -> None:
        from transformers import AutoModelForCausalLM

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs).eval()

    def greedy(self, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Token ids and the log-softmax row of each step, eos never stopping it."""
        return self.greedy_many([prompt], num_tokens)[0]

    @torch.inference_mode()
    def greedy_many(self, prompts: list[list[int]], num_tokens: int) -> list[tuple[list[int], list[torch.Tensor]]]:
        """``greedy`` of every prompt, run as one left-padded batch (a step reads the weights
        once for all prompts: several times faster on a real model on the CPU than one prompt
        at a time)."""
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
        results: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in prompts]
        for step in range(num_tokens):
            logprobs = torch.log_softmax(logits.float(), -1)
            chosen = torch.argmax(logprobs, -1)
            for row, (tokens, rows) in enumerate(results):
                tokens.append(int(chosen[row]))
                rows.append(logprobs[row])
            if step + 1 == num_tokens:
                break
            mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=mask.dtype)], -1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
        return results
