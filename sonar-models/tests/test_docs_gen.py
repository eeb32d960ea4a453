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
    assert "`unquantized`" in text


def test_quantization_matrix_names_only_tests_that_exist_and_run_the_format() -> None:
    """A platform the matrix calls tested points at a test file that exists and names the method."""
    from pathlib import Path

    from sonar.registry import import_class, quantization_methods

    root = Path(docs_gen.__file__).resolve().parents[3]
    text = docs_gen.render()
    for name, path in quantization_methods().items():
        cls = import_class(path) if isinstance(path, str) else path
        assert f"`{name}`" in text
        for platform, test in cls.tested_by.items():
            test_file = root / test
            assert test_file.is_file(), f"{name}: {test} does not exist"
            source = test_file.read_text()
            assert name == "unquantized" or name in source, f"{test} never names {name!r}"
            if platform == "cuda":
                assert "cuda" in source, f"{test} has no cuda-marked test"
