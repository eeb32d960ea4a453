"""The Triton attention backend over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar.attention import AttentionBackend, AttentionMetadata
from sonar_cuda.kernels.decode_attention import decode_attention
from sonar_cuda.kernels.kv_cache import reshape_and_cache
from sonar_cuda.kernels.prefill_attention import prefill_attention


@dataclass(slots=True)
class TritonStepState:
    """Per-step views and sizes shared by every layer (``AttentionMetadata.extra``)."""

    num_decodes: int
    decode_max_seq_len: int
    # prefill part: [num_prefills(+1)] views of the step's tensors
    prefill_query_start_loc: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_max_query_len: int
    # CUDA graphs: the decode kernel's split-KV factor, fixed at capture (None: chosen per step)
    decode_num_splits: int | None = None
    # CUDA graphs: the captured batch size this step replays (0: run the model eagerly)
    graph_batch_size: int = 0


class TritonAttentionBackend(AttentionBackend):
    """Writes each step's keys and values into the paged cache, then runs the decode kernel over
    the leading one-token sequences and the prefill kernel over the rest, in two launches.

    With ``sliding_window=W`` both kernels read only each token's last ``W`` positions: blocks
    before that are skipped (their block-table entries may be stale, the KV-cache manager having
    given those blocks back).

    An FP8 cache (``float8_e4m3fn`` or ``float8_e5m2``) is written as ``key / k_scale``,
    ``value / v_scale`` and read back as FP8 by both kernels, which dequantize in registers.

    With ``logit_softcap=c`` both kernels cap each scaled score at ``c * tanh(score / c)``
    before the masks and the softmax (Gemma 2)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be at least 1")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"logit_softcap={logit_softcap} must be positive (None: no cap on the scores)")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, logit_softcap)

    @classmethod
    def prepare_metadata(cls, metadata: AttentionMetadata) -> None:
        """Slice the step's tensors into the decode and prefill parts, once for all layers.

        A state the model runner set already (a CUDA-graph decode step) is kept as is."""
        if isinstance(metadata.extra, TritonStepState):
            return
        nd = metadata.num_decodes
        starts = metadata.query_start_loc_cpu
        prefill_query_lens = [starts[i + 1] - starts[i] for i in range(nd, metadata.num_seqs)]
        metadata.extra = TritonStepState(
            num_decodes=nd,
            decode_max_seq_len=max(metadata.seq_lens_cpu[:nd], default=0),
            prefill_query_start_loc=metadata.query_start_loc[nd:],
            prefill_seq_lens=metadata.seq_lens[nd:],
            prefill_block_tables=metadata.block_tables[nd:],
            prefill_max_query_len=max(prefill_query_lens, default=0),
        )

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write ``key``/``value`` at ``slot_mapping``, then attend causally over the paged cache
        (``k_scale`` / ``v_scale``: the layer's FP8 scales, ignored by other caches)."""
        if not isinstance(metadata.extra, TritonStepState):
            self.prepare_metadata(metadata)
        state: TritonStepState = metadata.extra
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = state.num_decodes
        # decode
        if nd:
            decode_attention(
                query[:nd], k_cache, v_cache, metadata.block_tables[:nd], metadata.seq_lens[:nd], self.scale,
                out=out[:nd], max_seq_len=state.decode_max_seq_len, num_splits=state.decode_num_splits,
                sliding_window=self.sliding_window, k_scale=k_scale, v_scale=v_scale, logit_softcap=self.logit_softcap,
            )
        # prefill and chunked prefill
        if state.prefill_max_query_len:
            prefill_attention(
                query, k_cache, v_cache, state.prefill_block_tables, state.prefill_seq_lens,
                state.prefill_query_start_loc, state.prefill_max_query_len, self.scale, out=out,
                sliding_window=self.sliding_window, k_scale=k_scale, v_scale=v_scale, logit_softcap=self.logit_softcap,
            )
        return out
