"""The OpenAI surface through the official ``openai`` SDK, against the offline LLM."""

from __future__ import annotations

import httpx
import openai
import pytest

from sonar import SamplingParams

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def greedy(oracle, prompt, max_tokens: int = 12, **kwargs):
    return oracle.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs))[0].outputs[0]


def test_models_lists_the_served_name(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == 512


def test_completion_greedy_equals_offline_llm(client, oracle):
    expected = greedy(oracle, PROMPT)
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert completion.choices[0].text == expected.text
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens == len(oracle.get_tokenizer().encode(PROMPT))


def test_token_id_and_list_prompts(client, oracle):
    ids = oracle.get_tokenizer().encode(PROMPT)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == greedy(oracle, {"prompt_token_ids": ids}, 6).text
    batch = client.completions.create(model="tiny", prompt=[PROMPT, "Once upon a time"], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in sorted(batch.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    texts = {c.index: c.text for c in batch.choices}
    assert texts[0] == texts[1] == greedy(oracle, PROMPT, 6).text
    assert texts[2] == texts[3] == greedy(oracle, "Once upon a time", 6).text


def test_streaming_completion_matches_and_reports_usage(client, oracle):
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy(oracle, PROMPT).text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_stop_string_ends_the_text_before_it(client, oracle):
    full = greedy(oracle, PROMPT, 16).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert plain.choices[0].text == expected
    assert plain.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_seed_makes_sampling_reproducible_and_n_gives_distinct_choices(client):
    def sample(seed: int) -> list[str]:
        result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=seed)
        return [c.text for c in sorted(result.choices, key=lambda c: c.index)]

    first, again, other = sample(7), sample(7), sample(8)
    assert first == again
    assert first != other
    assert first[0] != first[1]  # each choice gets its own seed


def test_completion_logprobs_match_offline_llm(client, oracle):
    expected = greedy(oracle, PROMPT, 5, logprobs=2)
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == 5
    for position, token_id in enumerate(expected.token_ids):
        assert logprobs.token_logprobs[position] == pytest.approx(expected.logprobs[position][token_id].logprob, abs=1e-4)
        assert len(logprobs.top_logprobs[position]) == 2
    assert "".join(logprobs.tokens) == completion.choices[0].text


def test_echo_prepends_the_prompt(client, oracle):
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert completion.choices[0].text == PROMPT + greedy(oracle, PROMPT, 4).text


def test_engine_sampling_fields_pass_as_extra_body(client, oracle):
    # top_k=1 is greedy whatever the temperature; ignore_eos and min_tokens reach the engine too
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.5, extra_body={"top_k": 1, "ignore_eos": True, "min_tokens": 8}
    )
    assert completion.choices[0].text == greedy(oracle, PROMPT, 8).text


def test_chat_greedy_equals_offline_chat(client, oracle):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    expected = oracle.chat(messages, SamplingParams(max_tokens=10, temperature=0.0))[0].outputs[0]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    assert chat.choices[0].message.content == expected.text
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == len(expected.token_ids)


def test_chat_stream_with_usage_n_and_logprobs(client, oracle):
    messages = [{"role": "user", "content": "Tell me a story"}]
    expected = oracle.chat(messages, SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0]
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=3,
    )
    texts = {0: "", 1: ""}
    num_logprobs = {0: 0, 1: 0}
    finish = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                num_logprobs[choice.index] += len(choice.logprobs.content)
                assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == {0: expected.text, 1: expected.text}
    assert num_logprobs == {0: 6, 1: 6}
    assert finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 12


def test_tokenize_and_detokenize_round_trip(server, oracle):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == oracle.get_tokenizer().encode(PROMPT)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPT}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == oracle.apply_chat_template([{"role": "user", "content": "hi"}])
