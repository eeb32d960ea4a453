"""Per-request sampling options, with vLLM's field names (and Aphrodite's for the extra samplers)."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sonar.structured_output.params import GuidedDecodingParams

_GREEDY_EPS = 1e-5
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 1024
# word lists (bad_words, dry_sequence_breakers) are tokenized when a request is admitted and bad
# words are looked up every step: bounded, so no request can make either the server's main cost
MAX_WORDS = 1024  # strings a word list may hold
MAX_WORD_CHARS = 256  # characters each of them may hold
MAX_BAD_WORD_SEQUENCES = 2 * MAX_WORDS  # bad_words_token_ids entries: each bad word becomes up to two (with and without a leading space)
MAX_BAD_WORD_TOKENS = 64  # tokens each of those entries may hold
# token-id lists are sets of tokens (repeats count once) and logit_bias maps tokens: none can
# hold more distinct entries than the vocabulary has tokens, which a frontend that knows the
# vocabulary checks before anything walks them (``check_token_id_counts``)
TOKEN_ID_FIELDS = ("allowed_token_ids", "stop_token_ids", "dry_sequence_breaker_ids", "logit_bias")
MAX_FREE_FORM_KEYS = 256  # keys of extra_args and of kv_transfer_params
FLOAT32_MAX = 3.4028234663852886e38  # the sampler computes in float32: a larger number is infinite there


def is_sampler_float(value: float) -> bool:
    """Whether a number is finite in the float32 arithmetic the sampler runs in."""
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "repetition_penalty_slope", "dry_multiplier", "dry_base", "xtc_threshold", "xtc_probability",
    "mirostat_tau", "mirostat_eta", "typical_p", "tfs", "top_a", "eta_cutoff", "epsilon_cutoff",
    "nsigma", "smoothing_factor", "smoothing_curve", "dynatemp_min", "dynatemp_max",
    "dynatemp_exponent", "skew",
)  # fmt: skip
_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "detokenize", "temperature_last")
DEFAULT_DRY_SEQUENCE_BREAKERS = ["\n", ":", '"', "*"]


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a streamed request holds (vLLM's names and values):
    everything so far, only what is new since the last one, or one output when finished."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token of one request.

    The first block are vLLM's fields. The extra samplers use Aphrodite's names; each is off at
    its default. ``eta_cutoff`` and ``epsilon_cutoff`` are in units of 1e-4 (as in Aphrodite).
    ``sampler_priority`` orders the stages (``sonar.sampler.SamplerID`` ids or stage names,
    plugins' stages included); stages not listed run after the listed ones, in the default
    order. ``bad_words`` are strings the engine tokenizes into ``bad_words_token_ids``;
    ``dry_sequence_breakers`` likewise into ``dry_sequence_breaker_ids`` (either id field may
    also be given directly); each list holds at most ``MAX_WORDS`` strings of ``MAX_WORD_CHARS``
    characters, and ``bad_words_token_ids`` at most ``MAX_BAD_WORD_SEQUENCES`` sequences of
    ``MAX_BAD_WORD_TOKENS`` tokens. ``stop_token_ids``, ``allowed_token_ids`` and
    ``dry_sequence_breaker_ids`` are sets of tokens: a repeated id counts once.
    ``extra_args`` (vLLM's field) carries the parameters of plugins' sampler stages under their
    namespaced names (``{"example.boost": 2.0}``); a namespaced key no registered stage
    declares, or a value that does not fit, is a ValueError naming it. ``extra_args`` and
    ``kv_transfer_params`` take at most ``MAX_FREE_FORM_KEYS`` keys; ``sampler_priority``
    lists each orderable stage at most once.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top-k alternatives per sampled token (0: only the sampled one)
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: as many as the context holds)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logits_processors: list[str] = field(default_factory=list)  # registered processor names, each run once
    output_kind: str = "cumulative"  # or a RequestOutputKind: "cumulative" everything so far, "delta" only the new, "final_only" once
    guided_decoding: GuidedDecodingParams | None = None  # structured output: json, regex, grammar, choice
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    allowed_token_ids: list[int] | None = None
    # repetition penalty window (Kobold's rep_pen_range / rep_pen_slope)
    repetition_penalty_range: int = 0  # last N context tokens; 0: all
    repetition_penalty_slope: float = 1.0  # older half of the window gets 1 + (penalty - 1) * slope
    # DRY
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_range: int = 0  # last N context tokens; 0: all
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DEFAULT_DRY_SEQUENCE_BREAKERS))
    dry_sequence_breaker_ids: list[int] | None = None
    # XTC
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0
    # mirostat
    mirostat_mode: int = 0  # 0 off, 1 or 2
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # truncation
    typical_p: float = 1.0
    tfs: float = 1.0
    top_a: float = 0.0
    eta_cutoff: float = 0.0
    epsilon_cutoff: float = 0.0
    nsigma: float = 0.0
    # shaping
    smoothing_factor: float = 0.0
    smoothing_curve: float = 1.0
    dynatemp_min: float = 0.0
    dynatemp_max: float = 0.0
    dynatemp_exponent: float = 1.0
    skew: float = 0.0
    no_repeat_ngram_size: int = 0
    temperature_last: bool = False
    sampler_priority: list[int | str] | None = None  # normalised: ids of stages that have one, else names
    extra_args: dict[str, Any] | None = None  # plugin stages' parameters, by namespaced name
    # KV connectors (vLLM's field): {"do_remote_decode": true} keeps a prefill's blocks for a
    # decode engine; the parameters a prefill returned make a decode engine pull them
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = OUTPUT_KINDS[self.output_kind]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple, type(None))):
                raise ValueError(f"{name} must be a list, got {_brief(value)}")
            setattr(self, name, list(value or []))
        for name in ("stop_token_ids", "allowed_token_ids", "dry_sequence_breaker_ids"):  # token sets: each id once
            value = getattr(self, name)
            if isinstance(value, list) and _all_of_types(value, (int, bool)):
                setattr(self, name, list(dict.fromkeys(value)))
        if self.top_k == -1:
            self.top_k = 0
        for name in _BOOL_FIELDS:  # 0 and 1 read as booleans (as pydantic reads them); the rest must be one
            value = getattr(self, name)
            if type(value) is int and value in (0, 1):
                setattr(self, name, bool(value))
        for name in _FLOAT_FIELDS:  # integers read as floats (one past a double's range stays, and is refused)
            value = getattr(self, name)
            if type(value) is int:
                try:
                    setattr(self, name, float(value))
                except OverflowError:
                    pass
        if isinstance(self.logit_bias, dict):
            bias = self.logit_bias
            try:
                if _all_of_types(bias, (int,)) and _all_of_types(bias.values(), (float,)):
                    self.logit_bias = dict(bias) or None  # already token ids to floats (a clone, the engine core's copy)
                else:
                    self.logit_bias = {int(k): float(v) for k, v in bias.items()} or None
            except (TypeError, ValueError, OverflowError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {_brief(self.logit_bias)}") from None
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.dry_sequence_breakers, str):
            self.dry_sequence_breakers = [self.dry_sequence_breakers]
        if self.guided_decoding is not None:
            self.guided_decoding = GuidedDecodingParams.from_value(self.guided_decoding)
        if isinstance(self.logits_processors, list) and all(isinstance(n, str) for n in self.logits_processors):
            self.logits_processors = list(dict.fromkeys(self.logits_processors))  # each named processor runs once
        for name in ("extra_args", "kv_transfer_params"):
            value = getattr(self, name)
            if isinstance(value, dict) and len(value) > MAX_FREE_FORM_KEYS:
                raise ValueError(f"{name} takes at most {MAX_FREE_FORM_KEYS} keys, got {len(value)}")
        if isinstance(self.extra_args, dict):
            self.extra_args = dict(self.extra_args) or None
        if self.kv_transfer_params is not None and not (
            isinstance(self.kv_transfer_params, dict) and all(isinstance(k, str) for k in self.kv_transfer_params)
        ):
            raise ValueError(f"kv_transfer_params must be a JSON object, got {self.kv_transfer_params!r}")
        self.validate()
        if self.sampler_priority is not None:
            table = _stage_table()
            self.sampler_priority = [table.priority_key(table.lookup(v)) for v in self.sampler_priority] or None

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """``SamplingParams`` of the given fields, those given as None left at their defaults
        (vLLM's constructor for optional request fields)."""
        return cls(**{name: value for name, value in kwargs.items() if value is not None})

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""

        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        def is_int(value: object) -> bool:
            """An integer a 64-bit signed field holds."""
            return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63

        def is_token_list(value: object) -> bool:
            """A list of non-negative 64-bit integers; read at C speed (it may hold a vocabulary)."""
            return isinstance(value, list) and _all_of_types(value, (int,)) and (not value or (min(value) >= 0 and max(value) < 2**63))

        def check_word_list(name: str, value: Any, requirement: str, empty_strings: bool) -> None:
            """A list of strings the input processor tokenizes: its length is checked first,
            so a huge one is refused before anything walks it."""
            check(isinstance(value, list), f"{name} {requirement}")
            check(len(value) <= MAX_WORDS, f"{name} takes at most {MAX_WORDS} strings, got {len(value)}")
            check(all(isinstance(w, str) and (empty_strings or w) for w in value), f"{name} {requirement}")
            check(all(len(w) <= MAX_WORD_CHARS for w in value), f"each of {name} may be at most {MAX_WORD_CHARS} characters long")

        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            ok = isinstance(value, float) or is_int(value)
            check(ok and is_sampler_float(value), f"{name} must be a finite number (float32: |x| <= 3.4e38), got {_brief(value)}")
        ints = ("n", "min_tokens", "top_k", "repetition_penalty_range", "dry_allowed_length", "dry_range",
                "mirostat_mode", "no_repeat_ngram_size")  # fmt: skip
        for name in ints:
            value = getattr(self, name)
            check(is_int(value), f"{name} must be an integer, got {_brief(value)}")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            check(isinstance(value, bool), f"{name} must be a boolean, got {_brief(value)}")

        # vLLM's fields
        check(self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(
            self.output_kind in OUTPUT_KINDS,
            f"output_kind must be 'cumulative', 'delta' or 'final_only' (or a RequestOutputKind), got {self.output_kind!r}",
        )
        check(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens!r}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}",
        )
        check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        truncate = self.truncate_prompt_tokens
        check(truncate is None or (is_int(truncate) and (truncate >= 1 or truncate == -1)),
              f"truncate_prompt_tokens must be an integer >= 1 (or -1: the model's context), got {truncate!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            # the engine's max_logprobs (20 unless raised) bounds it from above
            check(value is None or (is_int(value) and value >= 0), f"{name} must be an integer >= 0, got {value!r}")
        check(
            self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool) and -(2**63) <= self.seed < 2**64),
            f"seed must be a 64-bit integer, got {self.seed!r}",
        )
        # each streamed token is searched for every stop string: bounded, so no request can make
        # that search the server's main cost
        check(len(self.stop) <= MAX_STOP_STRINGS, f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        check(
            all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            f"each stop string may be at most {MAX_STOP_STRING_CHARS} characters long",
        )
        check(is_token_list(self.stop_token_ids), "stop_token_ids must be non-negative integers")
        check(self.logit_bias is None or isinstance(self.logit_bias, dict), "logit_bias must map token ids to numbers")
        bias = self.logit_bias or {}
        if not (is_token_list(list(bias)) and _all_of_types(bias.values(), (float, int)) and all(map(is_sampler_float, bias.values()))):
            for token_id, value in bias.items():  # the slow walk, only to name the entry at fault
                ok = is_int(token_id) and token_id >= 0 and isinstance(value, (float, int)) and not isinstance(value, bool)
                check(ok and is_sampler_float(value), f"logit_bias entry {token_id}: {_brief(value)} is invalid (a finite float32 number)")
        check(
            isinstance(self.logits_processors, list) and all(isinstance(n, str) for n in self.logits_processors),
            "logits_processors must be a list of registered processor names",
        )

        # token constraints
        if self.bad_words is not None:
            check_word_list("bad_words", self.bad_words, "must be a list of non-empty strings", empty_strings=False)
        words = self.bad_words_token_ids
        check(words is None or isinstance(words, list), "bad_words_token_ids must be a list of non-empty lists of token ids")
        check(
            len(words or ()) <= MAX_BAD_WORD_SEQUENCES,
            f"bad_words_token_ids takes at most {MAX_BAD_WORD_SEQUENCES} token sequences, got {len(words or ())}",
        )
        check(all(is_token_list(w) and w for w in words or ()), "bad_words_token_ids must be a list of non-empty lists of token ids")
        check(
            all(len(w) <= MAX_BAD_WORD_TOKENS for w in words or ()),
            f"each bad_words_token_ids sequence may be at most {MAX_BAD_WORD_TOKENS} tokens long",
        )
        check(
            self.allowed_token_ids is None or (is_token_list(self.allowed_token_ids) and len(self.allowed_token_ids) > 0),
            "allowed_token_ids must be a non-empty list of token ids",
        )

        # the extra samplers
        check(self.repetition_penalty_range >= 0, f"repetition_penalty_range must be >= 0, got {self.repetition_penalty_range}")
        check(self.repetition_penalty_slope >= 0.0, f"repetition_penalty_slope must be >= 0, got {self.repetition_penalty_slope}")
        check(self.dry_multiplier >= 0.0, f"dry_multiplier must be >= 0, got {self.dry_multiplier}")
        check(self.dry_base >= 1.0, f"dry_base must be >= 1, got {self.dry_base}")
        check(self.dry_allowed_length >= 0, f"dry_allowed_length must be >= 0, got {self.dry_allowed_length}")
        check(self.dry_range >= 0, f"dry_range must be >= 0, got {self.dry_range}")
        check_word_list("dry_sequence_breakers", self.dry_sequence_breakers, "must be a list of strings", empty_strings=True)
        check(
            self.dry_sequence_breaker_ids is None or is_token_list(self.dry_sequence_breaker_ids),
            "dry_sequence_breaker_ids must be a list of token ids",
        )
        check(0.0 <= self.xtc_threshold <= 1.0, f"xtc_threshold must be in [0, 1], got {self.xtc_threshold}")
        check(0.0 <= self.xtc_probability <= 1.0, f"xtc_probability must be in [0, 1], got {self.xtc_probability}")
        check(self.mirostat_mode in (0, 1, 2), f"mirostat_mode must be 0, 1 or 2, got {self.mirostat_mode}")
        check(self.mirostat_tau >= 0.0, f"mirostat_tau must be >= 0, got {self.mirostat_tau}")
        check(self.mirostat_eta >= 0.0, f"mirostat_eta must be >= 0, got {self.mirostat_eta}")
        check(0.0 < self.typical_p <= 1.0, f"typical_p must be in (0, 1], got {self.typical_p}")
        check(0.0 < self.tfs <= 1.0, f"tfs must be in (0, 1], got {self.tfs}")
        check(0.0 <= self.top_a <= 1.0, f"top_a must be in [0, 1], got {self.top_a}")
        check(self.eta_cutoff >= 0.0, f"eta_cutoff must be >= 0 (units of 1e-4), got {self.eta_cutoff}")
        check(0.0 <= self.epsilon_cutoff < 1e4, f"epsilon_cutoff must be in [0, 10000) (units of 1e-4), got {self.epsilon_cutoff}")
        check(self.nsigma >= 0.0, f"nsigma must be >= 0, got {self.nsigma}")
        check(self.smoothing_factor >= 0.0, f"smoothing_factor must be >= 0, got {self.smoothing_factor}")
        check(self.smoothing_curve >= 1.0, f"smoothing_curve must be >= 1, got {self.smoothing_curve}")
        check(self.dynatemp_min >= 0.0, f"dynatemp_min must be >= 0, got {self.dynatemp_min}")
        check(self.dynatemp_max >= 0.0, f"dynatemp_max must be >= 0, got {self.dynatemp_max}")
        check(
            self.dynatemp_max == 0.0 or self.dynatemp_min <= self.dynatemp_max,
            f"dynatemp_min={self.dynatemp_min} must not exceed dynatemp_max={self.dynatemp_max}",
        )
        check(self.dynatemp_exponent >= 0.0, f"dynatemp_exponent must be >= 0, got {self.dynatemp_exponent}")
        check(self.no_repeat_ngram_size >= 0, f"no_repeat_ngram_size must be >= 0, got {self.no_repeat_ngram_size}")
        if self.sampler_priority is not None:
            check(isinstance(self.sampler_priority, list), f"sampler_priority must be a list, got {_brief(self.sampler_priority)}")
            table = _stage_table()
            check(  # a longer list names a stage twice: refused before each entry is looked up
                len(self.sampler_priority) <= len(table.ordered),
                f"sampler_priority lists {len(self.sampler_priority)} stages; there are {len(table.ordered)} stages to order, each listed at most once",
            )
            try:
                names = [table.lookup(v).name for v in self.sampler_priority]
            except ValueError as exc:
                raise ValueError(f"sampler_priority: {exc}") from None
            check(len(set(names)) == len(names), f"sampler_priority lists a stage twice: {self.sampler_priority}")

        # free-form values still have to cross the engine-core wire
        for name in ("extra_args", "kv_transfer_params"):
            value = getattr(self, name)
            if value is not None:
                try:
                    msgspec.msgpack.encode(value)
                except (TypeError, ValueError, OverflowError) as exc:
                    raise ValueError(f"{name} holds a value that cannot be sent: {exc}") from None

        # plugins' stages
        if self.extra_args is not None:
            check(
                isinstance(self.extra_args, dict) and all(isinstance(k, str) for k in self.extra_args),
                f"extra_args must map parameter names to values, got {self.extra_args!r}",
            )
            _stage_table().check_extra_args(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0.0

    @property
    def uses_dynatemp(self) -> bool:
        return self.dynatemp_max > 0.0

    @property
    def reads_output_tokens(self) -> bool:
        """Whether sampling the next token needs the values of the tokens sampled before it
        (penalties, DRY, no-repeat-ngram, multi-token bad words, logits processors, a grammar);
        such a request's steps are not overlapped with the step that samples its previous token."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.dry_multiplier > 0.0
            or self.no_repeat_ngram_size > 0
            or any(len(word) > 1 for word in self.bad_words_token_ids or ())
            or bool(self.bad_words and self.bad_words_token_ids is None)
            or bool(self.logits_processors)
            or self.guided_decoding is not None
            or (self.extra_args is not None and _stage_table().reads_output_tokens(self))
        )

    def clone(self, **changes) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)

    def choice(self, seed: int | None) -> SamplingParams:
        """The parameters of one choice of a request with ``n`` > 1: ``n=1`` and its own
        ``seed`` (a valid seed: see ``input_processor.choice_seed``); every other field is
        this one's, shared rather than copied or checked again (a request of n choices with a
        vocabulary-wide logit_bias was checked n times: 4.5 s for n=64)."""
        child = object.__new__(SamplingParams)
        for name in self.__dataclass_fields__:
            object.__setattr__(child, name, getattr(self, name))
        child.n, child.seed = 1, seed
        return child


def check_token_id_counts(values: Mapping[str, Any], vocab_size: int) -> None:
    """Raise ValueError where a token-id list or ``logit_bias`` among ``values`` (SamplingParams
    keyword arguments, as a request sent them) has more entries than the vocabulary has tokens:
    a frontend calls it before building the SamplingParams, so an oversized list is refused
    without being walked (the constructor walks each entry, and repeats count once)."""
    for name in TOKEN_ID_FIELDS:
        value = values.get(name)
        if isinstance(value, (list, tuple, dict)) and len(value) > vocab_size:
            raise ValueError(
                f"{name} has {len(value)} entries; the model's vocabulary has {vocab_size} tokens, "
                "and each may be listed once"
            )


def _all_of_types(values: Any, types: tuple[type, ...]) -> bool:
    """Whether every one of ``values`` is exactly of one of ``types`` (no subclasses: a bool is
    no int here), read at C speed."""
    return set(map(type, values)) <= set(types)


def _brief(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: error messages echo what a client sent,
    which may be a whole request body's worth."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stage_table() -> Any:
    """The registered sampler stages (``sonar.sampler.stage_table.StageTable``)."""
    from sonar.registry import sampler_stages

    return sampler_stages()


def truncated_prompt(prompt_token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """The prompt a request with ``truncate_prompt_tokens`` runs: its last that many tokens
    (-1: the last ``max_model_len``), or the whole prompt without it."""
    if truncate_prompt_tokens is None:
        return prompt_token_ids
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return prompt_token_ids[-keep:] if len(prompt_token_ids) > keep else prompt_token_ids
