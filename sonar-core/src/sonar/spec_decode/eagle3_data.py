"""Training data for an EAGLE-3 head, from the target itself (self-distillation): prompts, the
target's own responses, and per position its auxiliary hidden states and final hidden state
(whose product with the target's head, restricted to the draft vocabulary, is the
distribution the head learns)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from sonar.attention import ForwardContext
from sonar.prompt_files import PROMPT_FIELDS, prompt_text, read_prompts  # noqa: F401 (this module's readers use them)
from sonar.sampler.metadata import RequestSamplingState
from sonar.sampling_params import SamplingParams
from sonar.worker.input_batch import CachedRequestState

MAX_TOKENS_PER_FORWARD = 4096

SELF_PROMPT_TOPICS = (
    "cooking", "travel", "personal finance", "a programming task in Python", "history", "physics", "fitness",
    "writing an email", "a math word problem", "gardening", "music", "job interviews", "learning a language",
    "space", "a short story", "health", "movies", "climate", "chess", "a poem",
)  # fmt: skip


@dataclass(slots=True)
class Sample:
    """One training sequence: ``token_ids`` (prompt then response), where the response
    starts, and the target's states at every position (on the host, float32)."""

    token_ids: list[int]
    num_prompt_tokens: int
    aux_states: torch.Tensor  # [T, num_aux * target_hidden]
    final_states: torch.Tensor  # [T, target_hidden] the target's last hidden state (after its norm)


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as a user turn in the tokenizer's chat template (plain tokens without one)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer.encode(text)


def self_written_prompts(llm: Any, count: int, seed: int) -> list[str]:
    """Prompts the target writes itself: asked, at temperature 1, for a question about one of
    ``SELF_PROMPT_TOPICS`` (for users who bring no prompts)."""
    rng = random.Random(seed)
    tokenizer = llm.get_tokenizer()
    requests = [
        {"prompt_token_ids": chat_prompt_ids(tokenizer, f"Write one question a user could ask an assistant about {rng.choice(SELF_PROMPT_TOPICS)}. Reply with the question only.")}
        for _ in range(count)
    ]
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=64, seed=seed + i) for i in range(count)]
    outputs = llm.generate(requests, params, use_tqdm=False)
    return [o.outputs[0].text.strip() or "Tell me something interesting." for o in outputs]


def generate_responses(llm: Any, prompt_ids: list[list[int]], max_tokens: int, temperature: float, use_tqdm: bool) -> list[list[int]]:
    """The target's responses (token ids) with Sonar's engine."""
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0 if temperature > 0 else None)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=use_tqdm)
    return [list(o.outputs[0].token_ids) for o in outputs]


def generate_samples(
    llm: Any, prompt_ids: list[list[int]], max_tokens: int, temperature: float, count: int, seed: int, use_tqdm: bool
) -> list[list[list[int]]]:
    """``count`` sampled responses per prompt (token ids), each drawn with a seed of its own
    (``seed``-derived, so a rerun draws the same ones)."""
    requests = [{"prompt_token_ids": p} for p in prompt_ids for _ in range(count)]
    params = [
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=(seed * 1_000_003 + i * count + j + 1) % 2**63)
        for i in range(len(prompt_ids)) for j in range(count)
    ]  # fmt: skip
    outputs = llm.generate(requests, params, use_tqdm=use_tqdm)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return [tokens[i * count : (i + 1) * count] for i in range(len(prompt_ids))]


ANSWERS_FORMAT = "sonar-drafter-answers"


def save_answers(path: str | Path, model: str, sequences: list[tuple[list[int], list[int]]], num_held_out: int) -> None:
    """Write the target's answers (``(prompt ids, answer ids)``, the first ``num_held_out``
    held out) as JSON, so other drafters train on exactly the same data."""
    record = {
        "format": ANSWERS_FORMAT, "version": 1, "model": model, "num_held_out": num_held_out,
        "sequences": [[list(p), list(r)] for p, r in sequences],
    }  # fmt: skip
    Path(path).write_text(json.dumps(record, separators=(",", ":")))


def load_answers(path: str | Path, vocab_size: int) -> tuple[str, list[tuple[list[int], list[int]]], int]:
    """``(model, sequences, num_held_out)`` of a file :func:`save_answers` wrote.

    :raises ValueError: not such a file, or a token id outside ``[0, vocab_size)`` (the
        answers of another model), naming what is wrong.
    """
    try:
        record = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error.msg})") from None
    if not isinstance(record, dict) or record.get("format") != ANSWERS_FORMAT or record.get("version") != 1:
        raise ValueError(f"{path}: not a drafter answers file (format {ANSWERS_FORMAT!r}, version 1)")
    sequences, held_out = record.get("sequences"), record.get("num_held_out")
    if not isinstance(sequences, list) or not isinstance(held_out, int) or not 1 <= held_out < len(sequences):
        raise ValueError(f"{path}: needs 'sequences' and a 'num_held_out' between 1 and one less than their count")
    pairs = []
    for number, pair in enumerate(sequences):
        ok = isinstance(pair, list) and len(pair) == 2 and all(isinstance(part, list) and part for part in pair)
        if not ok or len(pair[1]) < 2:
            raise ValueError(f"{path}: sequence {number} must be [prompt ids, answer ids] with at least 2 answer tokens")
        for part in pair:
            if not all(type(t) is int and 0 <= t < vocab_size for t in part):
                raise ValueError(f"{path}: sequence {number} has a token id outside the target's vocabulary of {vocab_size}")
        pairs.append((pair[0], pair[1]))
    return str(record.get("model", "")), pairs, held_out


def model_runner_of(llm: Any) -> Any:
    """The in-process model runner of an ``LLM`` (the trainer reads the target's states there)."""
    return llm.llm_engine._local_core("the drafter trainer").executor.worker.model_runner


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "model", model) if not hasattr(model, "aux_hidden_states") else model


@torch.inference_mode()
def target_states(runner: Any, sequences: list[list[int]], aux_layer_ids: list[int]) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence, the target's auxiliary states (``aux_layer_ids``, concatenated) and final
    hidden states of every position, from prefill passes over a scratch KV cache (the engine's
    own cache is left alone)."""
    model = runner.model
    aux = _unwrapped(model).aux_hidden_states
    previous = aux.ordered_ids
    aux.select(aux_layer_ids)
    core = _unwrapped(model)
    block_size = runner.block_size
    try:
        start = 0
        while start < len(sequences):
            group, total = [], 0
            while start + len(group) < len(sequences) and (not group or total + len(sequences[start + len(group)]) <= MAX_TOKENS_PER_FORWARD):
                total += len(sequences[start + len(group)])
                group.append(sequences[start + len(group)])
            yield from _prefill_states(runner, core, group, block_size)
            start += len(group)
    finally:
        aux.select(previous)


def _prefill_states(runner: Any, model: torch.nn.Module, group: list[list[int]], block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    lengths = [len(s) for s in group]
    num_blocks = sum(-(-n // block_size) for n in lengths)
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    scratch = [runner._zeros(shape) for _ in range(model.num_layers)]
    params = SamplingParams(max_tokens=1)
    states, next_block = [], 0
    for i, tokens in enumerate(group):
        sampling = RequestSamplingState(params=params, prompt_token_ids=tokens, output_token_ids=[], generator=None, eos_token_ids=[])
        states.append(CachedRequestState(req_id=f"drafter-trainer-{i}", prompt_token_ids=tokens, num_computed_tokens=0, sampling=sampling))
        count = -(-len(tokens) // block_size)
        runner.block_table.add(states[-1].req_id, list(range(next_block, next_block + count)))
        next_block += count
    try:
        batch = runner.build_batch(states, lengths)
        if runner.backend_cls is not None:
            runner.backend_cls.prepare_metadata(batch.attn_metadata)
        final = model(batch.input_ids, batch.positions, ForwardContext(batch.attn_metadata, scratch))
        aux = model.aux_hidden_states.latest
        starts = batch.token_starts()
        by_id = {}
        for row, state in enumerate(batch.states):
            rows = slice(starts[row], starts[row] + batch.num_scheduled[row])
            by_id[state.req_id] = (aux[rows].float().cpu(), final[rows].float().cpu())
        return [by_id[s.req_id] for s in states]
    finally:
        for state in states:
            runner.block_table.remove(state.req_id)


def target_head_rows(model: torch.nn.Module, token_ids: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """The target's output-head weight rows of ``token_ids`` ``[n, hidden]``, read through its
    ``compute_logits`` (whatever format its head is stored in)."""
    with torch.inference_mode():
        device = next(model.parameters()).device
        dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        identity = torch.eye(hidden_size, device=device, dtype=dtype)
        weight_t = model.compute_logits(identity)  # [hidden, vocab]
        return weight_t[:, token_ids.to(device)].T.float().cpu().clone()


def draft_vocabulary(samples: list[Sample], vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft vocabulary: the ``draft_vocab_size`` target tokens most frequent in the
    samples (responses counted; ties and unseen ids by id), ascending. Returns
    ``(target ids [draft_vocab], d2t [draft_vocab] int64, t2d [vocab] bool)``."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for sample in samples:
        counts += torch.bincount(torch.tensor(sample.token_ids[sample.num_prompt_tokens :], dtype=torch.int64), minlength=vocab_size)[:vocab_size].double()
    counts -= torch.arange(vocab_size, dtype=torch.float64) / (vocab_size * 10)  # ties: the lower id first
    ids = torch.topk(counts, draft_vocab_size).indices.sort().values
    d2t = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids, d2t, t2d
