from __future__ import annotations

from pathlib import Path

import pytest

from sonar_models.testing import TINY_CONFIGS, build_tiny_model, reuse_gguf_name_maps


@pytest.fixture(scope="session", autouse=True)
def _gguf_name_maps_reused() -> None:
    """transformers' GGUF loader (an oracle here) builds the same name maps hundreds of times."""
    reuse_gguf_name_maps()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(arch, root / arch) for arch in sorted(TINY_CONFIGS)}
