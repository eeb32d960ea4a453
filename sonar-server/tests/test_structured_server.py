"""Structured output through the HTTP surfaces: OpenAI ``response_format`` and ``guided_*``,
Kobold ``grammar``; guards against constraints that are invalid, slow or numerous."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from pathlib import Path

import httpx
import jsonschema
import openai
from conftest import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_chat_response_format(tools_client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe a person."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    text = tools_client.chat.completions.create(model="tiny", messages=messages, response_format=response_format, max_tokens=120, temperature=0).choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in tools_client.chat.completions.create(model="tiny", messages=messages, response_format=response_format, max_tokens=120, temperature=0, stream=True)
        if chunk.choices
    )
    assert streamed == text
    any_object = tools_client.chat.completions.create(model="tiny", messages=messages, response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    assert any_object.choices[0].message.content.startswith("{")


def test_completions_guided_fields(tools_client: openai.OpenAI) -> None:
    regex = tools_client.completions.create(model="tiny", prompt="Phone:", max_tokens=30, temperature=0.9, extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", regex.choices[0].text)
    choice = tools_client.completions.create(model="tiny", prompt="Pick:", max_tokens=10, n=3, temperature=1.0, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert {c.text for c in choice.choices} <= {"red", "green", "blue"}
    grammar = 'root ::= "SELECT " col " FROM t;"\ncol ::= "a" | "b" | "*"'
    sql = tools_client.completions.create(model="tiny", prompt="SQL:", max_tokens=20, temperature=0, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"SELECT (a|b|\*) FROM t;", sql.choices[0].text)
    schema = tools_client.completions.create(model="tiny", prompt="JSON:", max_tokens=120, temperature=0, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(schema.choices[0].text), SCHEMA)


def test_kobold_grammar(tools_url: str) -> None:
    body = {"prompt": "Answer yes or no:", "max_length": 10, "grammar": 'root ::= "yes" | "no"'}
    assert httpx.post(f"{tools_url}/api/v1/generate", json=body, timeout=30).json()["results"][0]["text"] in ("yes", "no")
    bad = httpx.post(f"{tools_url}/api/v1/generate", json={**body, "grammar": "root ::= "}, timeout=30)
    assert bad.status_code == 400 and "grammar" in bad.json()["detail"]["msg"]


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def test_bad_and_pathological_constraints_leave_the_server_responsive(tools_url: str, tools_client: openai.OpenAI) -> None:
    def post(extra: dict) -> httpx.Response:
        return httpx.post(f"{tools_url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 40, **extra}, timeout=60)

    started = time.perf_counter()
    invalid = post({"guided_regex": "(ab"})
    assert invalid.status_code == 400 and "guided_regex" in invalid.json()["error"]["message"]
    both = post({"guided_regex": "a", "guided_choice": ["b"]})
    assert both.status_code == 400 and "one structured-output constraint" in both.json()["error"]["message"]
    body = '{"model": "tiny", "prompt": "x", "max_tokens": 4, "guided_json": ' + '{"type": "object", "properties": {"x": ' * 1000 + '{"type": "integer"}' + "}}" * 1000 + "}"
    nested = httpx.post(f"{tools_url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert nested.status_code == 400
    nested_70 = post({"guided_json": deep_schema(70)})
    assert nested_70.status_code == 400 and "nests deeper" in nested_70.json()["error"]["message"]
    catastrophic = post({"guided_regex": "(a+)+$", "temperature": 0})
    assert catastrophic.status_code == 200 and re.fullmatch("a+", catastrophic.json()["choices"][0]["text"])
    assert time.perf_counter() - started < 30
    assert httpx.get(f"{tools_url}/health").status_code == 200
    assert tools_client.completions.create(model="tiny", prompt="still", max_tokens=3).choices[0].text is not None


def random_schema(rng: random.Random, i: int) -> dict:
    properties = {f"k{i}": {"type": "integer", "minimum": 0, "maximum": rng.randint(1, 999)}}
    if rng.random() < 0.5:
        properties["flag"] = {"type": "boolean"}
    if rng.random() < 0.5:
        properties["kind"] = {"enum": [f"v{j}" for j in range(rng.randint(1, 4))]}
    return {"type": "object", "properties": properties, "required": list(properties)}


def test_sixty_four_concurrent_schemas(tools_url: str) -> None:
    rng = random.Random(3)
    schemas = [random_schema(rng, i) for i in range(64)]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as session:
            requests = [
                session.post(f"{tools_url}/v1/completions", json={"model": "tiny", "prompt": f"Item {i}", "max_tokens": 80, "temperature": 0.8, "guided_json": s})
                for i, s in enumerate(schemas)
            ]
            return await asyncio.gather(*requests)

    for schema, response in zip(schemas, asyncio.run(run())):
        assert response.status_code == 200
        jsonschema.validate(json.loads(response.json()["choices"][0]["text"]), schema)


def test_many_distinct_schemas_in_a_row_stay_within_memory(tools_server: ServerProcess, tools_url: str) -> None:
    pid = tools_server.process.pid
    schemas = [{"type": "object", "properties": {"id": {"const": i}}, "required": ["id"]} for i in range(600)]

    async def send(batch: list[dict]) -> None:
        async with httpx.AsyncClient(timeout=60) as session:
            for start in range(0, len(batch), 8):
                requests = [
                    session.post(f"{tools_url}/v1/completions", json={"model": "tiny", "prompt": "id:", "max_tokens": 12, "temperature": 0, "guided_json": s})
                    for s in batch[start : start + 8]
                ]
                for response, schema in zip(await asyncio.gather(*requests), batch[start : start + 8]):
                    assert json.loads(response.json()["choices"][0]["text"]) == {"id": schema["properties"]["id"]["const"]}

    asyncio.run(send(schemas[:100]))
    before = rss_bytes(pid)
    asyncio.run(send(schemas[100:]))
    assert rss_bytes(pid) - before < 64 * 1024 * 1024  # the grammar cache is bounded
    assert httpx.get(f"{tools_url}/health").status_code == 200


def test_constraints_are_tried_in_the_api_servers_compile_processes_only(tools_server: ServerProcess, tools_url: str) -> None:
    """The API server tries each new constraint in its compile processes (which can be killed);
    the engine core, which gets only constraints that passed, compiles them directly and
    starts no compile process of its own."""
    from pathlib import Path

    def children(pid: int) -> dict[int, str]:
        found = {}
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except (OSError, ValueError, IndexError):
                continue
        return found

    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["answer"]}
    response = httpx.post(f"{tools_url}/v1/completions", json={"model": "tiny", "prompt": "n:", "max_tokens": 20, "temperature": 0, "guided_json": schema}, timeout=60)
    assert response.status_code == 200
    jsonschema.validate(json.loads(response.json()["choices"][0]["text"]), schema)
    api_children = children(tools_server.process.pid)
    (core,) = [pid for pid, title in api_children.items() if title.startswith("sonar::engine-core")]
    assert [pid for pid, title in api_children.items() if title.startswith("sonar::grammar-compile")], api_children
    assert not [title for title in children(core).values() if title.startswith("sonar::grammar-compile")]
