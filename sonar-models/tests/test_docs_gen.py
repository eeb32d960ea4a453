"""docs/models.md is generated from the registries and kept up to date."""

from __future__ import annotations

from sonar_models import docs_gen


def test_model_matrix_is_up_to_date() -> None:
    assert docs_gen.DEFAULT_OUTPUT.read_text() == docs_gen.render(), "run: python -m sonar_models.docs_gen"


def test_model_matrix_lists_every_registered_architecture() -> None:
    from sonar.registry import model_architectures

    text = docs_gen.render()
    for arch in model_architectures():
        assert f"`{arch}`" in text
    assert "Q4_1" in text and "Q8_0" in text
