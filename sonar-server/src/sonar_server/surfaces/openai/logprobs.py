"""OpenAI's two logprob formats, from the engine's ``{token_id: Logprob}`` per position.
Logprobs are written as vLLM writes them (``strict_json.finite_logprob``): at least ``-9999.0``,
so the ``-inf`` of a token that cannot be drawn is ``-9999.0``."""

from __future__ import annotations

from typing import Any

from sonar.outputs import Logprob
from sonar_server.generation import decoded_token
from sonar_server.state import ServerState
from sonar_server.strict_json import finite_logprob


def tokens_as_ids(state: ServerState, body: Any) -> bool:
    """Whether logprobs name tokens as ``token_id:N``: the request's
    ``return_tokens_as_token_ids``, else ``--return-tokens-as-token-ids``."""
    asked = getattr(body, "return_tokens_as_token_ids", None)
    return state.settings.return_tokens_as_token_ids if asked is None else bool(asked)


def _name(state: ServerState, token_id: int, logprob: Logprob | None, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else decoded_token(state, token_id, logprob)


def _chosen(state: ServerState, token_id: int, entry: dict[int, Logprob] | None, as_ids: bool) -> tuple[str, float | None]:
    logprob = entry.get(token_id) if entry else None
    return _name(state, token_id, logprob, as_ids), (finite_logprob(logprob.logprob) if logprob is not None else None)


def completion_logprobs(
    state: ServerState,
    token_ids: list[int],
    entries: list[dict[int, Logprob] | None],
    num_top: int,
    text_offset: int,
    as_ids: bool = False,
) -> dict[str, Any]:
    """The legacy completions format: parallel lists of tokens, logprobs, top alternatives
    and text offsets. Each position's alternatives are its ``num_top`` most likely tokens
    and the chosen one where it is not among them (up to ``num_top + 1``, as OpenAI and vLLM
    give them). ``as_ids``: tokens named ``token_id:N``."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float | None] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries):
        text, value = _chosen(state, token_id, entry, as_ids)
        tokens.append(text)
        token_logprobs.append(value)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            top_logprobs.append(None)
            continue
        if num_top <= 0:
            top_logprobs.append({text: value})
            continue
        ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)[:num_top]
        top = {_name(state, t, lp, as_ids): finite_logprob(lp.logprob) for t, lp in ranked}
        if all(t != token_id for t, _ in ranked):
            top[text] = value
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(state: ServerState, token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int, as_ids: bool = False) -> dict[str, Any]:
    """The chat format: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``
    (``as_ids``: tokens named ``token_id:N``)."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        text, value = _chosen(state, token_id, entry, as_ids)
        ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)[:num_top] if num_top else []
        top = []
        for alt_id, alt in ranked:
            alt_text = _name(state, alt_id, alt, as_ids)
            top.append({"token": alt_text, "logprob": finite_logprob(alt.logprob), "bytes": list(alt_text.encode("utf-8"))})
        content.append({"token": text, "logprob": value, "bytes": list(text.encode("utf-8")), "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_json(state: ServerState, entries: list[dict[int, Logprob] | None] | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """A request's ``prompt_logprobs`` as vLLM writes them: per prompt token None (the first)
    or ``{token id: {"logprob", "rank", "decoded_token"}}``."""
    if entries is None:
        return None
    return [
        None if entry is None else {
            str(token_id): {"logprob": finite_logprob(lp.logprob), "rank": lp.rank, "decoded_token": decoded_token(state, token_id, lp)}
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]
