"""API field names of the samplers: the OpenAI extra body fields Aphrodite's users send (its
names, which are ``SamplingParams``' own)."""

from __future__ import annotations

# sent by Aphrodite's users as extra body fields of /v1/completions and /v1/chat/completions
OPENAI_EXTRA_SAMPLING_FIELDS: tuple[str, ...] = (
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "bad_words", "allowed_token_ids", "prompt_logprobs", "logits_processors",
    "dry_multiplier", "dry_base", "dry_allowed_length", "dry_range", "dry_sequence_breakers",
    "xtc_threshold", "xtc_probability", "mirostat_mode", "mirostat_tau", "mirostat_eta",
    "typical_p", "tfs", "top_a", "eta_cutoff", "epsilon_cutoff", "smoothing_factor",
    "smoothing_curve", "dynatemp_min", "dynatemp_max", "dynatemp_exponent", "nsigma",
    "no_repeat_ngram_size", "skew", "temperature_last", "sampler_priority",
    "repetition_penalty_range", "repetition_penalty_slope",
)  # fmt: skip
