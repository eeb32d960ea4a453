from __future__ import annotations

from pathlib import Path

import pytest

from sonar_models.testing import TINY_CONFIGS, build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(arch, root / arch) for arch in sorted(TINY_CONFIGS)}
