"""Timing the target's forward step by the number of tokens in it, on the worker's device, once
the KV cache exists (for ``sonar.engine.step_cost.StepCostModel``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from sonar.attention import ForwardContext
from sonar.sampler.metadata import RequestSamplingState
from sonar.sampling_params import SamplingParams
from sonar.worker.input_batch import CachedRequestState

if TYPE_CHECKING:
    from sonar.worker.model_runner import ModelRunner

PROFILE_CONTEXT_LEN = 512  # the context each profiled sequence attends to (at most half of max_model_len)
PROFILE_REPEATS = 3  # timed runs per token count (after one warm-up); the fastest counts
PROFILE_POINT_S = 0.05  # a count whose runs took less than this is run again, up to PROFILE_MAX_REPEATS times
PROFILE_MAX_REPEATS = 10
PROFILE_MIN_POINTS = 2  # counts timed whatever the budget: a curve needs a slope (a loaded host may spend the budget on one)
PROFILE_BUDGET_S = {"cpu": 1.0}  # wall time a profile may take, by device type; others: DEFAULT
DEFAULT_PROFILE_BUDGET_S = 20.0


def decode_shaped_step(num_tokens: int, max_num_seqs: int, context_len: int, vocab_size: int) -> tuple[list[CachedRequestState], list[int]]:
    """Dummy requests for a step of ``num_tokens`` tokens shaped like decoding: one token for
    each of ``num_tokens`` sequences up to ``max_num_seqs``, and beyond that verify steps
    (each sequence's known token plus drafts, the tokens spread evenly), every sequence after
    a context of ``context_len`` tokens, sampling greedily."""
    num_seqs = min(num_tokens, max_num_seqs)
    per_seq = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    states = []
    for i, count in enumerate(per_seq):
        prompt = [(i * 31 + j) % vocab_size for j in range(context_len + 1)]
        sampling = RequestSamplingState(params=params, prompt_token_ids=prompt, output_token_ids=[], generator=None, eos_token_ids=[])
        drafts = [(i + j) % vocab_size for j in range(count - 1)]
        states.append(
            CachedRequestState(
                req_id=f"step-cost-{i}", prompt_token_ids=prompt, num_computed_tokens=context_len, sampling=sampling, draft_token_ids=drafts,
            )
        )
    return states, per_seq


def profile_step_seconds(
    runner: ModelRunner, platform: type, token_counts: list[int], context_len: int | None = None, repeats: int = PROFILE_REPEATS,
    budget_s: float | None = None, max_logits_rows: int | None = None,
) -> tuple[list[int], list[float], int]:
    """Time a step of each of ``token_counts`` (increasing) through ``runner``'s own batch
    building and forward (its CUDA graphs where a step fits one), the logits of its rows (at
    most ``max_logits_rows``: a real step has logits for its decodes and drafts only), their
    verification where the runner speculates (else their argmax), and the read-back of the
    tokens; the fastest of ``repeats`` runs after a warm-up counts (of more runs, up to
    ``PROFILE_MAX_REPEATS``, for a step so short that ``repeats`` of them take less than
    ``PROFILE_POINT_S``: one run that the host slowed down then matters less).

    The steps write keys and values into the runner's KV cache (which holds nothing yet: run
    this before the first request), the sequences spread over its blocks (sharing them when
    there are fewer than they need). Stops early, before a count whose step would take the
    profile past ``budget_s`` (estimated from the last one), once ``PROFILE_MIN_POINTS``
    counts are timed, and skips counts whose tokens per sequence (``max_num_seqs`` sequences)
    would not fit ``max_model_len``; the counts left out are extrapolated by the cost model.
    Returns the counts timed, their seconds and the context length used.
    """
    config = runner.config
    model = runner.model
    num_blocks = runner.kv_caches[0].shape[1]
    block_size = runner.block_size
    max_seqs = config.max_num_seqs
    # a sequence holds its context and its step's tokens within max_model_len (and the cache):
    # counts whose tokens per sequence would not fit are left to the cost model's extrapolation
    room = min(config.max_model_len, num_blocks * block_size) - 1
    token_counts = [n for n in token_counts if -(-n // min(n, max_seqs)) <= room] or token_counts[:1]
    longest = -(-token_counts[-1] // min(token_counts[-1], max_seqs))  # tokens per sequence at the largest count
    if context_len is None:
        context_len = min(PROFILE_CONTEXT_LEN, config.max_model_len // 2)
    context_len = max(0, min(context_len, config.max_model_len - longest - 1, num_blocks * block_size - longest - 1))
    if budget_s is None:
        budget_s = PROFILE_BUDGET_S.get(runner.device.type, DEFAULT_PROFILE_BUDGET_S)
    started = time.perf_counter()
    counts, seconds = [], []
    for num_tokens in token_counts:
        expected = max(repeats + 1, 2) * seconds[-1] * num_tokens / counts[-1] if seconds else 0.0
        if len(seconds) >= PROFILE_MIN_POINTS and time.perf_counter() - started + expected > budget_s:
            break
        states, per_seq = decode_shaped_step(num_tokens, max_seqs, context_len, runner.model_config.vocab_size)
        blocks_per_seq = -(-(context_len + max(per_seq)) // block_size)
        for i, state in enumerate(states):
            runner.block_table.add(state.req_id, [(i * blocks_per_seq + j) % num_blocks for j in range(blocks_per_seq)])
        try:
            best, spent, attempt = float("inf"), 0.0, 0
            while attempt <= repeats or (spent < PROFILE_POINT_S and attempt <= PROFILE_MAX_REPEATS):
                platform.synchronize()
                begin = time.perf_counter()
                _run_step(runner, model, states, per_seq, max_logits_rows)
                platform.synchronize()
                elapsed = time.perf_counter() - begin
                if attempt:  # the first run warms up
                    best = min(best, elapsed)
                    spent += elapsed
                attempt += 1
        finally:
            for state in states:
                runner.block_table.remove(state.req_id)
        counts.append(num_tokens)
        seconds.append(best)
    return counts, seconds, context_len


@torch.inference_mode()
def _run_step(
    runner: ModelRunner, model: torch.nn.Module, states: list[CachedRequestState], per_seq: list[int], max_logits_rows: int | None
) -> None:
    batch = runner.build_batch(states, per_seq)
    if runner.backend_cls is not None:
        runner.backend_cls.prepare_metadata(batch.attn_metadata)
    hidden = model(batch.input_ids, batch.positions, ForwardContext(batch.attn_metadata, runner.kv_caches))
    indices = batch.logits_indices
    logits = model.compute_logits(hidden[indices[:max_logits_rows]])
    drafts = batch.sample_drafts
    if runner.spec is not None and drafts is not None and (max_logits_rows is None or len(indices) <= max_logits_rows):
        # a verify step: the verifier over every draft and bonus position, as the runner runs it
        states = [batch.states[row].sampling for row in batch.sample_rows]
        runner.spec.verify(runner.sampler, logits, states, drafts).result.token_ids.tolist()
    else:
        logits.argmax(dim=-1).tolist()
