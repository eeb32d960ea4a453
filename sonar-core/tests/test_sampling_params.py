"""Sampling parameters refuse what they cannot carry: whatever the constructor accepts crosses
the engine-core wire, so no request is admitted that the engine core would drop unread."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from sonar.engine import wire
from sonar.engine.input_processor import InputProcessor, _encode_all
from sonar.sampling_params import (
    MAX_BAD_WORD_SEQUENCES,
    MAX_BAD_WORD_TOKENS,
    MAX_FREE_FORM_KEYS,
    MAX_WORD_CHARS,
    MAX_WORDS,
    SamplingParams,
    check_token_id_counts,
)
from sonar.structured_output.params import MAX_JSON_VALUES, GuidedDecodingParams
from sonar_models.testing import smollm2_tokenizer

HOSTILE = [None, True, False, 0, 1, 2, -1, 2**63, 2**64, 10**30, 0.5, -0.5, float("nan"), float("inf"), "", "x", "true",
           [], [1], ["a"], [[1]], [None], {}, {"a": 1}, {"1": 2.0}, {"1": []}, {"x": 1}, {"ns.x": 1}]  # fmt: skip


def test_whatever_is_accepted_crosses_the_wire() -> None:
    rng = random.Random(0)
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    accepted = 0
    for _ in range(3000):
        values = {name: rng.choice(HOSTILE) for name in rng.sample(names, rng.choice([1, 1, 2, 3]))}
        try:
            params = SamplingParams(**values)
        except ValueError:
            continue  # refused with a message: the server's 400
        accepted += 1
        request = wire.EngineCoreRequest("r", [1, 2], params, 4, 0.0)
        decoded = wire.decode_request([bytes(frame) for frame in wire.encode_request(request)])
        assert decoded.sampling_params == params, values
    assert accepted > 150  # the fuzz reached accepted values too


@pytest.mark.parametrize("name", ["ignore_eos", "skip_special_tokens", "detokenize", "include_stop_str_in_output", "temperature_last"])
def test_booleans_take_booleans_and_read_0_and_1_as_them(name: str) -> None:
    assert getattr(SamplingParams(**{name: 1}), name) is True and getattr(SamplingParams(**{name: 0}), name) is False
    for value in ({"a": 1}, [], "yes", 2, 0.5, None):
        with pytest.raises(ValueError, match=f"{name} must be a boolean"):
            SamplingParams(**{name: value})


def test_containers_of_the_wrong_type_are_refused_naming_the_field() -> None:
    for values, field in (({"stop": 5}, "stop"), ({"stop_token_ids": 7}, "stop_token_ids"), ({"logit_bias": {"1": []}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**values)


def test_stop_strings_are_bounded() -> None:
    assert len(SamplingParams(stop=["x" * 1024] * 256).stop) == 256
    with pytest.raises(ValueError, match="at most 256 strings"):
        SamplingParams(stop=["ab"] * 257)
    with pytest.raises(ValueError, match="at most 1024 characters"):
        SamplingParams(stop=["x" * 1025])


def test_word_lists_are_bounded_before_anything_walks_them() -> None:
    words = ["w" * MAX_WORD_CHARS] * MAX_WORDS
    assert len(SamplingParams(bad_words=words, dry_sequence_breakers=words).bad_words) == MAX_WORDS
    for field in ("bad_words", "dry_sequence_breakers"):
        with pytest.raises(ValueError, match=f"{field} takes at most 1024 strings, got 200000"):
            SamplingParams(**{field: ["w"] * 200_000})
        with pytest.raises(ValueError, match=f"each of {field} may be at most 256 characters"):
            SamplingParams(**{field: ["w" * (MAX_WORD_CHARS + 1)]})
    sequences = [[1] * MAX_BAD_WORD_TOKENS] * MAX_BAD_WORD_SEQUENCES
    assert len(SamplingParams(bad_words_token_ids=sequences).bad_words_token_ids) == 2048
    with pytest.raises(ValueError, match="bad_words_token_ids takes at most 2048 token sequences, got 2049"):
        SamplingParams(bad_words_token_ids=sequences + [[1]])
    with pytest.raises(ValueError, match="bad_words_token_ids sequence may be at most 64 tokens"):
        SamplingParams(bad_words_token_ids=[[1] * 65])


def test_a_bad_word_longer_than_the_token_limit_is_refused_naming_it() -> None:
    processor = InputProcessor(SimpleNamespace(), smollm2_tokenizer())
    resolved = processor.resolve_word_lists(SamplingParams(bad_words=["hello", "world"] * (MAX_WORDS // 2)))
    assert len(resolved.bad_words_token_ids) == 4  # each word with and without a leading space, repeats once
    long_word = "zq" * 100  # well within the characters, far past 64 tokens
    with pytest.raises(ValueError, match=r"bad_words entry 'zqzq.*' is \d+ tokens long; a bad word may be at most 64 tokens"):
        processor.resolve_word_lists(SamplingParams(bad_words=["fine", long_word]))


def test_token_id_lists_are_sets_bounded_by_the_vocabulary_before_anything_walks_them() -> None:
    params = SamplingParams(allowed_token_ids=[7, 5, 7, 5] * 1000, dry_sequence_breaker_ids=[3, 3, 1], stop_token_ids=[2, 2])
    assert (params.allowed_token_ids, params.dry_sequence_breaker_ids, params.stop_token_ids) == ([7, 5], [3, 1], [2])
    vocab = 49152
    full = {"allowed_token_ids": list(range(vocab)), "logit_bias": {str(t): 1.0 for t in range(vocab)}}
    check_token_id_counts(full, vocab)  # the whole vocabulary is a legitimate list
    assert len(SamplingParams(**full).allowed_token_ids) == vocab
    for field in ("allowed_token_ids", "stop_token_ids", "dry_sequence_breaker_ids", "logit_bias"):
        # entries that are not even token ids: only the count is read, nothing is walked
        oversized = dict.fromkeys(map(str, range(vocab + 1)), None) if field == "logit_bias" else [None] * 2_000_000
        with pytest.raises(ValueError, match=f"{field} has {len(oversized)} entries; the model's vocabulary has 49152 tokens"):
            check_token_id_counts({field: oversized}, vocab)
    check_token_id_counts({"allowed_token_ids": None, "stop": ["x"] * 100_000}, vocab)  # other fields are not its business


def test_a_vocabulary_wide_logit_bias_is_read_as_sent_and_checked_in_one_pass() -> None:
    vocab = 49152
    sent = {str(t): 0.5 for t in range(vocab)}
    params = SamplingParams(n=4, seed=7, logit_bias=sent, allowed_token_ids=list(range(vocab)))
    assert params.logit_bias == {t: 0.5 for t in range(vocab)}
    request = wire.EngineCoreRequest("r", [1, 2], params, 4, 0.0)
    assert wire.decode_request([bytes(frame) for frame in wire.encode_request(request)]).sampling_params == params
    for bad, entry in (({"5": 1.0, "-3": 1.0}, "logit_bias entry -3"), ({"5": float("inf")}, "logit_bias entry 5: inf"), ({"5": True}, None)):
        if entry is None:
            assert SamplingParams(logit_bias=bad).logit_bias == {5: 1.0}  # a JSON true reads as 1, as pydantic reads it
        else:
            with pytest.raises(ValueError, match=entry):
                SamplingParams(logit_bias=bad)
    for ids in ([1, -1], [True], [1, 2.0], [2**63]):
        with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list of token ids"):
            SamplingParams(allowed_token_ids=ids)


def test_each_choice_of_a_request_shares_its_checked_parameters() -> None:
    params = SamplingParams(n=3, seed=2**64 - 2, logit_bias={str(t): 1.0 for t in range(1000)}, stop=["x"], temperature=0.7)
    choices = [params.choice(seed) for seed in (2**64 - 2, 2**64 - 1, 0)]
    assert [(c.n, c.seed) for c in choices] == [(1, 2**64 - 2), (1, 2**64 - 1), (1, 0)]
    assert all(c.logit_bias is params.logit_bias and c.stop is params.stop and c.temperature == 0.7 for c in choices)
    assert (params.n, params.seed) == (3, 2**64 - 2)
    assert choices[0] == params.clone(n=1)  # the same parameters a clone (checked again) would hold


def test_stage_lists_and_free_form_maps_are_bounded_before_they_are_walked() -> None:
    with pytest.raises(ValueError, match=r"sampler_priority lists 1000000 stages; there are \d+ stages to order"):
        SamplingParams(sampler_priority=["no such stage"] * 1_000_000)  # refused by count, not looked up entry by entry
    assert SamplingParams(sampler_priority=["temperature", "top_k"]).sampler_priority
    for field in ("extra_args", "kv_transfer_params"):
        assert SamplingParams(**{field: {f"k{i}": i for i in range(MAX_FREE_FORM_KEYS)}})
        with pytest.raises(ValueError, match=f"{field} takes at most 256 keys, got 300000"):
            SamplingParams(**{field: {f"k{i}": i for i in range(300_000)}})
    with pytest.raises(ValueError, match="stop takes at most 256 strings, got 1000000"):
        SamplingParams(stop=[None] * 1_000_000)  # the count is refused before the entries' types are read


def test_a_prompt_longer_than_the_context_is_refused_before_its_ids_are_read() -> None:
    processor = InputProcessor(SimpleNamespace(max_model_len=512, vocab_size=49152), None)
    with pytest.raises(ValueError, match="the prompt is 2000000 tokens, the model's context is 512 tokens"):
        processor.validate([None] * 2_000_000, SamplingParams())


def test_a_json_schema_walk_stops_at_its_bound() -> None:
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_JSON_VALUES)}}
    with pytest.raises(ValueError, match="the JSON schema holds more than 100000 values"):
        GuidedDecodingParams(json=wide)
    assert GuidedDecodingParams(json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}).json


def test_a_logits_processor_named_many_times_runs_once() -> None:
    params = SamplingParams(logits_processors=["b", "a", "b"] * 10_000)
    assert params.logits_processors == ["b", "a"]


def test_word_lists_tokenize_in_one_batch_as_encode_does_each() -> None:
    """bad_words and DRY's breakers are tokenized in one batched call: the same ids as
    ``tokenizer.encode`` of each text alone, on random text (spaces, accents, emoji, newlines)."""
    tokenizer = smollm2_tokenizer()
    rng = random.Random(11)
    texts = ["".join(rng.choice("ab cdé😀\n\t.") for _ in range(rng.randint(0, 12))) for _ in range(3000)] + [" hello", "world", ""]
    assert _encode_all(tokenizer, texts) == [tokenizer.encode(text, add_special_tokens=False) for text in texts]
