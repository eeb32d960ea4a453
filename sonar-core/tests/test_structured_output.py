"""Structured output end to end on a tiny random model: whatever the model would say, the
output parses and validates; greedy decoding only changes where the grammar forbids a token;
preempted requests resume inside their grammar."""

from __future__ import annotations

import json
import random
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from sonar import LLM, SamplingParams
from sonar.structured_output import GuidedDecodingParams

KV_CACHE_BYTES = 16 * 1024 * 1024


@pytest.fixture(scope="module")
def model_path() -> Iterator[str]:
    from sonar_models.testing import build_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="sonar-structured-"))
    build_tiny_model("llama", folder)
    yield str(folder)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def llm(model_path: str) -> LLM:
    return LLM(model_path, kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=512)


# -- schemas whose instances are short, so a random model's output always closes ----------------


def _leaf(rng: random.Random, name: str) -> dict[str, Any]:
    kind = rng.choice(["int", "number", "enum", "string", "bool", "pattern"])
    if kind == "int":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100])}
    if kind == "enum":
        return {"enum": [f"{name}_{i}" for i in range(rng.randint(1, 4))]}
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 5)}
    if kind == "pattern":
        return {"type": "string", "pattern": "^[a-f0-9]{2,6}$"}
    return {"type": "boolean"}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A nested object of bounded leaves, arrays (maxItems) and sub-objects; every property required."""
    properties: dict[str, Any] = {}
    for i in range(rng.randint(1, 3)):
        name = f"f{depth}{i}"
        roll = rng.random()
        if roll < 0.25 and depth < 1:
            properties[name] = random_schema(rng, depth + 1)
        elif roll < 0.45:
            properties[name] = {"type": "array", "items": _leaf(rng, name), "minItems": 1, "maxItems": 2}
        else:
            properties[name] = _leaf(rng, name)
    return {"type": "object", "properties": properties, "required": list(properties)}


def guided(**kwargs: Any) -> GuidedDecodingParams:
    return GuidedDecodingParams(**kwargs)


def test_fifty_json_schemas_validate(llm: LLM) -> None:
    rng = random.Random(5)
    schemas = [random_schema(rng) for _ in range(50)]
    params = [
        SamplingParams(max_tokens=300, temperature=0.0 if i % 2 else 1.0, seed=i if i % 10 == 1 else None, guided_decoding=guided(json=schema))
        for i, schema in enumerate(schemas)
    ]
    outputs = llm.generate([f"Record {i}:" for i in range(50)], params)
    for schema, output in zip(schemas, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_object_and_schema_as_text(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    outputs = llm.generate(
        ["A", "B"],
        [
            SamplingParams(max_tokens=60, temperature=0.0, guided_decoding=guided(json_object=True)),
            SamplingParams(max_tokens=50, temperature=0.0, guided_decoding={"json": json.dumps(schema)}),
        ],
    )
    first, second = (o.outputs[0] for o in outputs)
    if first.finish_reason == "stop":  # free-form keys may run long; when it closes it parses
        assert isinstance(json.loads(first.text), dict)
    assert first.text.startswith("{")
    assert json.loads(second.text) == {"ok": json.loads(second.text)["ok"]}


@pytest.mark.parametrize(
    "pattern",
    [r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{5,20}\.", r"#[0-9a-fA-F]{6}"],
)
def test_regexes_match(llm: LLM, pattern: str) -> None:
    outputs = llm.generate(
        ["Answer:"] * 3,
        [SamplingParams(max_tokens=60, temperature=t, guided_decoding=guided(regex=pattern)) for t in (0.0, 0.8, 1.5)],
    )
    for output in outputs:
        assert re.fullmatch(pattern, output.outputs[0].text), output.outputs[0].text


def test_choices_and_grammar(llm: LLM) -> None:
    choices = ["positive", "negative", "neutral ☺", 'with "quotes"']
    outputs = llm.generate(
        ["Sentiment:"] * 4,
        [SamplingParams(max_tokens=20, temperature=1.0, guided_decoding=guided(choice=choices)) for _ in range(4)],
    )
    assert all(o.outputs[0].text in choices for o in outputs)
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    text = llm.generate("Sum:", SamplingParams(max_tokens=80, temperature=0.0, guided_decoding=guided(grammar=grammar)))[0].outputs[0].text
    assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", text), text


def test_permissive_grammar_leaves_greedy_output_unchanged(llm: LLM) -> None:
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    anything = free.clone(guided_decoding=guided(regex=r"[\s\S]*"))
    plain, constrained = llm.generate(["The ocean is", "The ocean is"], [free, anything])
    assert constrained.outputs[0].token_ids == plain.outputs[0].token_ids


def test_greedy_under_grammar_equals_free_greedy_wherever_allowed(llm: LLM) -> None:
    import xgrammar as xgr
    from sonar.structured_output.compiler import get_grammar_compiler
    from sonar.structured_output.matcher import RequestGrammar

    engine = llm.llm_engine
    constraint = guided(regex=r"( [a-zA-Z]{1,12}){1,30}\.")
    prompt_ids = engine.tokenizer.encode("Once upon a time")
    constrained = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=200, temperature=0.0, guided_decoding=constraint))
    tokens = constrained[0].outputs[0].token_ids
    assert len(tokens) > 3
    # the free model's greedy choice after every prefix of the constrained output
    prefixes = [{"prompt_token_ids": prompt_ids + tokens[:i]} for i in range(len(tokens))]
    free = [o.outputs[0].token_ids[0] for o in llm.generate(prefixes, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))]
    compiled = get_grammar_compiler(engine.model_config.model).compile(constraint)
    grammar = RequestGrammar(compiled)
    bitmask = xgr.allocate_token_bitmask(1, engine.model_config.vocab_size)
    num_allowed = 0
    for position, (chosen, wanted) in enumerate(zip(tokens, free)):
        grammar.matcher.fill_next_token_bitmask(bitmask)
        allowed = bool((int(bitmask[0, wanted // 32]) >> (wanted % 32)) & 1)
        if allowed:
            num_allowed += 1
            assert chosen == wanted, f"position {position}: grammar allowed {wanted} but {chosen} was chosen"
        else:
            assert chosen != wanted
        assert grammar.accept(chosen)
    assert num_allowed >= 2  # the comparison above really happened


def small_schema(rng: random.Random, i: int) -> dict[str, Any]:
    properties: dict[str, Any] = {f"k{i}": {"type": "integer", "minimum": 0, "maximum": rng.randint(1, 999)}}
    if rng.random() < 0.5:
        properties["kind"] = {"enum": [f"v{j}" for j in range(rng.randint(1, 4))]}
    return {"type": "object", "properties": properties, "required": list(properties)}


def test_sixty_four_concurrent_schemas(llm: LLM) -> None:
    rng = random.Random(64)
    schemas = [small_schema(rng, i) for i in range(64)]
    outputs = llm.generate(
        [f"Item {i}" for i in range(64)],
        [SamplingParams(max_tokens=100, temperature=0.8, guided_decoding=guided(json=s)) for s in schemas],
    )
    for schema, output in zip(schemas, outputs):
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


def test_mixed_batch_leaves_free_rows_alone(llm: LLM) -> None:
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = llm.generate("Hello there", free)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["Hello there", "Hello there"],
        [free, SamplingParams(max_tokens=16, temperature=0.0, guided_decoding=guided(choice=["a", "b"]))],
    )
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].text in ("a", "b")


def test_preempted_requests_resume_inside_their_grammar(model_path: str, llm: LLM) -> None:
    rng = random.Random(11)
    schemas = [random_schema(rng) for _ in range(8)]
    params = [SamplingParams(max_tokens=100, temperature=0.0, guided_decoding=guided(json=s)) for s in schemas]
    prompts = [f"Entry number {i}:" for i in range(8)]
    roomy = llm.generate(prompts, params)
    small = LLM(model_path, kv_cache_memory_bytes=10 * 8192, max_model_len=128)  # 10 blocks of 16 tokens
    tight = small.generate(prompts, params)
    assert small.llm_engine.get_stats().num_preemptions > 0
    num_closed = 0
    for schema, a, b in zip(schemas, roomy, tight):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        if b.outputs[0].finish_reason == "stop":  # the short context may cut a long one
            jsonschema.validate(json.loads(b.outputs[0].text), schema)
            num_closed += 1
    assert num_closed >= 5


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"regex": "(ab"}, "invalid guided_regex"),
        ({"grammar": "root ::= "}, "invalid guided_grammar"),
        ({"json": {"type": "objectx"}}, "invalid guided_json"),
    ],
)
def test_invalid_constraints_are_rejected_when_added(llm: LLM, bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate("x", SamplingParams(max_tokens=4, guided_decoding=guided(**bad)))
    assert not llm.llm_engine.has_unfinished_requests()


def test_params_validation() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        GuidedDecodingParams(json="{not json")
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(guided_decoding={"jsonn": {}})
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(1000):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(ValueError, match="nests deeper"):
        GuidedDecodingParams(json=deep)
    assert SamplingParams(guided_decoding={"choice": ["a"]}).guided_decoding == GuidedDecodingParams(choice=["a"])
    assert GuidedDecodingParams(json={"b": 1, "a": 2}).cache_key() == GuidedDecodingParams(json='{"a": 2, "b": 1}').cache_key()


def test_bitmask_fills_all_rows_in_one_call_and_masks_only_constrained_rows(llm: LLM) -> None:
    from sonar.structured_output.bitmask import GrammarBitmask
    from sonar.structured_output.compiler import get_grammar_compiler
    from sonar.structured_output.matcher import RequestGrammar

    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    compiler = get_grammar_compiler(engine.model_config.model)
    digits = RequestGrammar(compiler.compile(guided(regex=r"[0-9]+")))
    letters = RequestGrammar(compiler.compile(guided(choice=["abc"])))
    logits = torch.randn(3, vocab)
    original = logits.clone()
    masked_rows = GrammarBitmask(vocab).apply(logits, [digits, None, letters])
    assert masked_rows == [0, 2]
    assert torch.equal(logits[1], original[1])
    tokenizer = engine.tokenizer
    allowed_digits = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed_digits and all(tokenizer.decode([t]).isdigit() for t in allowed_digits)
    allowed_letters = [tokenizer.decode([t]) for t in torch.isfinite(logits[2]).nonzero().flatten().tolist()]
    assert allowed_letters and all("abc".startswith(text) for text in allowed_letters)
    finite = torch.isfinite(logits)
    assert torch.equal(logits[finite], original[finite])  # allowed logits are untouched
