"""KoboldCpp's prompt: ``memory`` before ``prompt``, fitted into the request's context.

KoboldCpp puts a generate body's ``memory`` (a story's standing notes) before its ``prompt``
and, where the two and ``max_length`` exceed the context (``max_context_length`` where the
request sets one, at most the server's), cuts what does not fit from the front of the prompt,
then from the front of the memory; a beginning-of-text token the tokenizer puts first stays
first. Kobold clients send a whole story and rely on it."""

from __future__ import annotations

from sonar_server.errors import ApiError
from sonar_server.prompts import encode_prompt
from sonar_server.state import ServerState


def fit_to_context(lead: list[int], memory_ids: list[int], prompt_ids: list[int], room: int) -> list[int]:
    """``lead + memory + prompt`` (each without ``lead``) in at most ``room`` tokens: the
    excess comes off the front of the prompt, then of the memory; ``lead`` (the tokenizer's
    leading special tokens, often none) always stays."""
    memory, prompt = _without(lead, memory_ids), _without(lead, prompt_ids)
    excess = len(lead) + len(memory) + len(prompt) - room
    if excess > 0:
        cut = min(excess, len(prompt))
        prompt, excess = prompt[cut:], excess - cut
        memory = memory[excess:] if excess > 0 else memory
    return [*lead, *memory, *prompt]


def _without(lead: list[int], ids: list[int]) -> list[int]:
    return ids[len(lead) :] if lead and ids[: len(lead)] == lead else ids


async def kobold_prompt_ids(
    state: ServerState, prompt: str, memory: str | None, max_context_length: int | None, max_length: int
) -> tuple[list[int], str | None]:
    """A generate body's prompt token ids, KoboldCpp's way (module docstring), and the prompt
    text where they are its own (None where memory was added or the prompt cut).

    :raises ApiError: 400 where ``max_context_length`` is not a positive integer or leaves no
        room for a prompt beside ``max_length``."""
    context = state.max_model_len
    if max_context_length is not None:
        if max_context_length < 1:
            raise ApiError(400, f"max_context_length must be a positive integer, got {max_context_length}", param="max_context_length")
        context = min(context, max_context_length)
    room = context - max_length
    if max_context_length is not None and room < 1 <= state.max_model_len - max_length:
        raise ApiError(400, f"max_length={max_length} leaves no room for a prompt in max_context_length={max_context_length}", param="max_length")
    prompt_ids = await encode_prompt(state, prompt)
    if room < 1:  # max_length alone exceeds the server's context: the engine's check says so
        return prompt_ids, prompt
    lead = await encode_prompt(state, "")
    memory_ids = await encode_prompt(state, memory) if memory else []
    if not memory_ids and len(prompt_ids) <= room:
        return prompt_ids, prompt
    return fit_to_context(lead, memory_ids, prompt_ids, room), None
