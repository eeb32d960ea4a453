"""KoboldCpp's memory and context fitting on ``/api/v1/generate``: ``memory`` goes before the
prompt, and what exceeds the context comes off the prompt's front, then the memory's."""

from __future__ import annotations

import httpx
import pytest

from sonar import SamplingParams
from sonar_server.surfaces.kobold.context import fit_to_context

MEMORY = "[The hero carries a lantern and a map.]\n"
STORY = " ".join(f"Step {i}: the hero walks deeper into the cave." for i in range(80))


def test_the_prompt_loses_its_front_first_then_the_memory_and_the_lead_stays():
    lead, memory, prompt = [1], [1, 10, 11, 12], [1, 20, 21, 22, 23]
    assert fit_to_context(lead, memory, prompt, 100) == [1, 10, 11, 12, 20, 21, 22, 23]
    assert fit_to_context(lead, memory, prompt, 6) == [1, 10, 11, 12, 22, 23]
    assert fit_to_context(lead, memory, prompt, 3) == [1, 11, 12]
    assert fit_to_context([], [10, 11], [20, 21, 22], 4) == [10, 11, 21, 22]  # no lead: nothing pinned
    assert fit_to_context([], [10, 11], [20, 21, 22], 1) == [11]


def _expected(oracle, memory: str, prompt: str, room: int, max_length: int) -> str:
    engine = oracle.llm_engine
    lead = engine.encode("")
    ids = fit_to_context(lead, engine.encode(memory) if memory else [], engine.encode(prompt), room)
    params = SamplingParams(max_tokens=max_length, temperature=0.0)
    return oracle.generate({"prompt_token_ids": ids}, params)[0].outputs[0].text


def _generate(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/api/v1/generate", json={"temperature": 0, "rep_pen": 1.0, **body}, timeout=60)


def test_memory_goes_before_the_prompt(server, oracle):
    response = _generate(server, prompt="You are in a dark cave. You", memory=MEMORY, max_length=8)
    assert response.status_code == 200, response.text
    assert response.json()["results"][0]["text"] == _expected(oracle, MEMORY, "You are in a dark cave. You", 512 - 8, 8)


def test_max_context_length_cuts_the_story_front_and_keeps_the_memory(server, oracle):
    assert len(oracle.llm_engine.encode(STORY)) > 64
    response = _generate(server, prompt=STORY, memory=MEMORY, max_length=8, max_context_length=64)
    assert response.status_code == 200, response.text
    assert response.json()["results"][0]["text"] == _expected(oracle, MEMORY, STORY, 64 - 8, 8)


def test_a_prompt_longer_than_the_server_context_is_cut_to_fit(server, oracle):
    story = " ".join([STORY] * 3)
    assert len(oracle.llm_engine.encode(story)) > 512
    response = _generate(server, prompt=story, max_length=6)
    assert response.status_code == 200, response.text
    assert response.json()["results"][0]["text"] == _expected(oracle, "", story, 512 - 6, 6)


@pytest.mark.parametrize(("body", "field"), [({"max_context_length": 0}, "max_context_length"), ({"max_context_length": 16, "max_length": 16}, "max_length"),
                                             ({"memory": {"x": 1}}, "memory")])
def test_a_context_with_no_room_or_a_bad_memory_is_refused(server, body, field):
    response = _generate(server, **{"prompt": "You are", "max_length": 4, **body})
    assert response.status_code == 400
    assert field in response.json()["detail"]["msg"]
