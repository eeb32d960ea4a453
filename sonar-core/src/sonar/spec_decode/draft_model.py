"""The draft-model proposer: a smaller causal LM with the target's vocabulary drafts the next
tokens one at a time, from its own KV cache.

``speculative_config={"method": "draft_model", "model": FOLDER, "num_speculative_tokens": k}``.
The drafter is built and loaded the way the target is (the same registered architectures and
weight formats, the target's dtype, device and attention backend). Each ``propose`` call, per
request, rolls the drafter back to the tokens the target accepted (its KV of rejected drafts
is overwritten), catches up on the tokens it has not seen (the whole prompt the first time,
then the step's accepted tokens), and drafts ``k`` tokens in ``k`` forward passes batched over
all requests of the call: the catch-up pass yields the first draft, each one-token pass the
next. A greedy request's drafts are the argmax of the drafter's processed logits; a sampled
request's are drawn from the drafter's distribution under the request's own sampling
parameters (and seeded generator), and that distribution goes to the verifier, which then
does real rejection sampling.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sonar import ops
from sonar.attention import ForwardContext
from sonar.config import ModelConfig
from sonar.sampler.metadata import RequestSamplingState, SamplingMetadata
from sonar.sampler.rows import row_exponentials
from sonar.sampler.sampler import Sampler
from sonar.sampling_params import SamplingParams
from sonar.spec_decode.draft_kv import DraftKVCache
from sonar.spec_decode.interface import (
    DraftTokens,
    Proposer,
    ProposerInputs,
    SpeculativeConfig,
)

if TYPE_CHECKING:
    from sonar.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PENDING = -1  # a fed draft whose value is still on the device


@dataclass(slots=True)
class DraftSequence:
    """What the drafter's cache holds for one request: ``token_ids[p]`` was fed at position
    ``p`` (real tokens, then the drafts of the last call); the first ``num_confirmed`` are
    known to be the request's own tokens."""

    token_ids: list[int]
    num_confirmed: int = 0


@dataclass(slots=True)
class _Chunk:
    req_id: str
    start: int  # first position fed
    num_tokens: int


def read_draft_model(config: SpeculativeConfig) -> tuple[Path, str, Any]:
    """The draft model's local path, weight format and Hugging Face config (its config file
    is read, never its weights).

    :raises ValueError: no ``model`` is given, the folder is missing or unreadable, or no
        registered architecture runs it.
    """
    from sonar.engine.model_source import resolve_model_path
    from sonar.engine.resolve import select_weight_format
    from sonar.registry import architecture_of

    if not config.model:
        raise ValueError(
            f'speculative_config method {config.method!r} needs "model": the folder of a smaller model '
            "with the target's tokenizer"
        )
    try:
        path = resolve_model_path(config.model)
        format_name, fmt = select_weight_format(path, "auto")
        hf_config = fmt.load_hf_config(path)
        architecture_of(hf_config)
    except (ValueError, OSError) as exc:
        raise ValueError(f"speculative_config['model'] {config.model!r}: {exc}") from None
    return path, format_name, hf_config


def draft_model_config(config: SpeculativeConfig, target: ModelConfig, platform: str) -> ModelConfig:
    """The drafter's model config: its own folder, architecture and weights in the target's
    dtype, with a context as long as the target's plus the drafts (or its own, if shorter).

    :raises ValueError: as ``read_draft_model``, or its vocabulary differs from the target's.
    """
    from sonar.engine.resolve import resolve_quantization

    path, format_name, hf_config = read_draft_model(config)
    vocab_size = hf_config.vocab_size
    if vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config['model'] {config.model!r} has a vocabulary of {vocab_size} tokens, the target "
            f"model {target.vocab_size}: a draft model must share the target's tokenizer (the same vocabulary)"
        )
    own_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    return ModelConfig(
        model=str(path),
        served_name=str(config.model),
        hf_config=hf_config,
        dtype=target.dtype,
        max_model_len=min(own_len, target.max_model_len + config.num_speculative_tokens),
        vocab_size=vocab_size,
        load_format=format_name,
        quantization=resolve_quantization(None, hf_config, platform),
    )


class DraftModelProposer(Proposer):
    """Drafts with a smaller model of the target's vocabulary (``method: "draft_model"``).

    Its KV cache is paged, ``min(max_num_seqs, disable_by_batch_size)`` sequences of its
    context long, allocated at load and shared on demand (see :class:`DraftKVCache`).
    """

    def __init__(self, config: SpeculativeConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.runner: ModelRunner | None = None
        self.model: torch.nn.Module | None = None
        self.model_config: ModelConfig | None = None
        self.kv: DraftKVCache | None = None
        self.sequences: dict[str, DraftSequence] = {}
        self.sampler = Sampler()
        self._no_sampling = RequestSamplingState(SamplingParams(temperature=0.0), [], [], None, [])

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        """A ``model`` is given, exists, and a registered architecture runs it (its config
        file is read, not its weights)."""
        read_draft_model(config)

    def bind_runner(self, runner: ModelRunner) -> None:
        """Take the runner's configuration: the drafter is built as the target was."""
        self.runner = runner

    def load_model(self, target_model: torch.nn.Module) -> None:
        """Build the drafter, load its weights and allocate its KV cache.

        :raises ValueError: its vocabulary is not the target's (checked before any weight loads).
        """
        from sonar.worker.model_runner import build_model, load_weights

        runner = self.runner
        if runner is None:
            raise RuntimeError("the draft-model proposer runs inside a model runner (bind_runner was not called)")
        model_config = self.model_config = draft_model_config(self.config, runner.model_config, runner.config.platform)
        model = build_model(model_config, self.device, runner.backend_cls)
        load_weights(model, model_config)
        self.model = model.to(self.device).eval()
        engine = runner.config
        num_seqs = max(1, min(engine.max_num_seqs, self.config.max_batch_size))
        max_blocks_per_seq = -(-model_config.max_model_len // runner.block_size)
        self.kv = DraftKVCache(
            model.num_layers, model.num_kv_heads, model.head_dim, model_config.dtype, runner.block_size,
            num_seqs * max_blocks_per_seq, max_blocks_per_seq, self.device,
        )
        runner.profile_parts["draft_kv_cache_bytes"] = self.kv.num_bytes
        logger.info(
            "draft model %s loaded; its KV cache holds %d sequences of %d tokens (%.1f MiB)",
            model_config.served_name, num_seqs, model_config.max_model_len, self.kv.num_bytes / 2**20,
        )

    def remove_requests(self, req_ids: set[str]) -> None:
        """Free the drafter's blocks of finished, aborted or preempted requests."""
        for req_id in req_ids:
            self.sequences.pop(req_id, None)
            self.kv.free(req_id)

    @torch.inference_mode()
    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        """Roll back, catch up and draft ``num_speculative_tokens`` tokens per request."""
        k = self.config.num_speculative_tokens
        token_ids: list[list[int]] = [[] for _ in inputs.req_ids]
        rows = self._prepare(inputs)
        if not rows:
            return DraftTokens(list(inputs.req_ids), token_ids)
        sampling = inputs.sampling or [self._no_sampling] * len(inputs.req_ids)
        logits = self._catch_up(inputs, rows)  # [len(rows), vocab]
        meta = SamplingMetadata.build([sampling[i] for i in rows], logits.shape[-1], self.device)
        step_drafts: list[torch.Tensor] = []
        step_probs: list[torch.Tensor] = []
        for position in range(k):
            drafted, probs = self._pick(logits, meta)
            step_drafts.append(drafted)
            if probs is not None:
                step_probs.append(probs)
            if position + 1 < k:  # fed from the device: the host reads the drafts once, below
                logits = self._forward([self._feed(inputs.req_ids[row], PENDING) for row in rows], drafted)
        drafted_ids = torch.stack(step_drafts, dim=1).tolist()  # [len(rows), k]
        for row, drafts in zip(rows, drafted_ids):
            token_ids[row] = drafts
            fed = self.sequences[inputs.req_ids[row]].token_ids
            fed[len(fed) - (k - 1) :] = drafts[: k - 1]
        probs_of: list[torch.Tensor | None] | None = None
        if step_probs:
            stacked = torch.stack(step_probs, dim=1)  # [len(rows), k, vocab]
            probs_of = [None] * len(inputs.req_ids)
            for i, row in enumerate(rows):
                if not sampling[row].params.greedy:
                    probs_of[row] = stacked[i]
        return DraftTokens(list(inputs.req_ids), token_ids, probs_of)

    # -- one call ------------------------------------------------------------------------

    def _prepare(self, inputs: ProposerInputs) -> list[int]:
        """Roll each request back to what its cache holds of its real tokens and give it
        room for this call; returns the rows that draft (a sequence the drafter's context
        cannot hold, or for which no blocks are free, drafts nothing)."""
        k = self.config.num_speculative_tokens
        keep = set(inputs.req_ids)
        rows = []
        for row, (req_id, sequence) in enumerate(zip(inputs.req_ids, inputs.token_ids)):
            length = len(sequence)
            evicted = self.kv.allocate(req_id, length + k - 1, keep) if length + k - 1 <= self.model_config.max_model_len else None
            for other in evicted or ():
                self.sequences.pop(other, None)
            if evicted is None:
                self.kv.free(req_id)
                self.sequences.pop(req_id, None)
                continue
            state = self.sequences.setdefault(req_id, DraftSequence([]))
            fed = state.token_ids
            end = min(len(fed), length - 1)  # the last token is always fed again: its logits draft
            valid = min(state.num_confirmed, end)
            while valid < end and fed[valid] == sequence[valid]:
                valid += 1
            del fed[valid:]  # rejected drafts: their KV is overwritten below
            state.num_confirmed = valid
            rows.append(row)
        return rows

    def _catch_up(self, inputs: ProposerInputs, rows: list[int]) -> torch.Tensor:
        """Feed every request the tokens its cache lacks, in passes of at most
        ``max_num_batched_tokens`` tokens; ``[len(rows), vocab]`` the logits after each
        request's last token, in row order."""
        pending: list[_Chunk] = []  # what each request still has to feed
        for row in rows:
            req_id, sequence = inputs.req_ids[row], inputs.token_ids[row]
            state = self.sequences[req_id]
            start = len(state.token_ids)
            state.token_ids.extend(sequence[start:])
            state.num_confirmed = len(sequence)
            pending.append(_Chunk(req_id, start, len(sequence) - start))
        budget = self.runner.config.max_num_batched_tokens
        last_logits: dict[str, torch.Tensor] = {}
        while pending:
            chunks, still, left = [], [], budget
            for rest in pending:
                count = min(rest.num_tokens, left)
                if count > 0:
                    chunks.append(_Chunk(rest.req_id, rest.start, count))
                    left -= count
                if count < rest.num_tokens:
                    still.append(_Chunk(rest.req_id, rest.start + count, rest.num_tokens - count))
            ends = {c.req_id for c in chunks} - {c.req_id for c in still}
            logits = self._forward(chunks)
            for chunk, row_logits in zip([c for c in chunks if c.req_id in ends], logits):
                last_logits[chunk.req_id] = row_logits
            pending = still
        return torch.stack([last_logits[inputs.req_ids[row]] for row in rows])

    def _feed(self, req_id: str, token_id: int) -> _Chunk:
        """Append a draft (or its placeholder) to the request's fed tokens; the one-token
        chunk that feeds it."""
        fed = self.sequences[req_id].token_ids
        fed.append(token_id)
        return _Chunk(req_id, len(fed) - 1, 1)

    def _forward(self, chunks: list[_Chunk], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run the drafter over ``chunks`` (each a run of its request's fed tokens, or, with
        ``input_ids``, one token each whose value is there on the device); ``[n, vocab]`` the
        logits of the chunks that end at their request's last fed token, in the order of
        ``chunks``."""
        from sonar.worker.input_batch import CachedRequestState, build_step_batch

        states = [
            CachedRequestState(c.req_id, self.sequences[c.req_id].token_ids, c.start, self._no_sampling) for c in chunks
        ]
        backend_cls = self.runner.backend_cls
        batch = build_step_batch(states, [c.num_tokens for c in chunks], self.kv.block_table, self.kv.block_size, self.device)
        if input_ids is not None:  # one-token chunks: the batch keeps their order
            batch.input_ids.copy_(input_ids)
        if backend_cls is not None:
            backend_cls.prepare_metadata(batch.attn_metadata)
        hidden = self.model(batch.input_ids, batch.positions, ForwardContext(batch.attn_metadata, self.kv.kv_caches))
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [len(sample_rows), vocab], decodes first
        index_of = {batch.states[row].req_id: i for i, row in enumerate(batch.sample_rows)}
        order = [index_of[c.req_id] for c in chunks if c.req_id in index_of]
        if order == list(range(len(order))):
            return logits
        return logits[torch.tensor(order, device=logits.device)]

    def _pick(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B]`` the drafts of one position: the argmax of the processed logits for greedy
        rows, a draw from the request's distribution for the others; and ``[B, vocab]`` that
        distribution (None: every row is greedy)."""
        processed = self.sampler.process(logits, meta)
        greedy_ids = None if meta.all_random else ops.argmax(processed)
        if meta.all_greedy:
            return greedy_ids, None
        probs = self.sampler.final_probabilities(processed, meta)
        exponentials = row_exponentials(tuple(probs.shape), meta.generators, probs.device)
        sampled = ops.argmax(probs / exponentials)
        if greedy_ids is not None:
            sampled = torch.where(meta.greedy_mask, greedy_ids, sampled)
        return sampled, probs
