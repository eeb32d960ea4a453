"""What the engine hands a speculative proposer each step, and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config is read where torch is not imported yet (argument parsing)
    import torch

    from sonar.sampler.metadata import RequestSamplingState
    from sonar.spec_decode.draft_graphs import GraphCapturer
    from sonar.worker.model_runner import ModelRunner

DEFAULT_NUM_SPECULATIVE_TOKENS = 3
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
VERIFICATION_POLICIES = ("fixed", "confidence")
CONFIDENCE_BY_DEFAULT = ("dspark",)  # methods whose drafts come with survival estimates
NO_BATCH_LIMIT = 1 << 30  # confidence-scheduled verification without disable_by_batch_size


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``speculative_config`` as users give it (vLLM's keys).

    :param method: the registered proposer (``"ngram"``, ``"eagle3"``, ``"dflash"``, ...).
    :param num_speculative_tokens: draft tokens proposed per request and step.
    :param model: the draft model's folder, for methods that run one.
    :param prompt_lookup_min: n-gram methods: the shortest suffix matched.
    :param prompt_lookup_max: n-gram methods: the longest suffix matched.
    :param disable_by_batch_size: no drafts in a step whose running requests outnumber it
        (a large batch is bound by compute, not by reading the weights, and verifying drafts
        would slow it down); None: the engine's default, ``DEFAULT_DISABLE_BY_BATCH_SIZE``
        with fixed verification, no limit with confidence-scheduled verification (its policy
        weighs every step's cost itself).
    :param verification: which drafts a step verifies. ``"fixed"``: all of them (up to the
        step's token budget and the request's ``max_tokens``) while the batch is within
        ``disable_by_batch_size``. ``"confidence"``: per step and request, the prefix whose
        expected accepted tokens are worth their cost on a step-time curve profiled on the
        device at start-up (``sonar.spec_decode.verification``). None: ``"confidence"`` for
        methods whose proposer estimates survival (``CONFIDENCE_BY_DEFAULT``: DSpark),
        ``"fixed"`` for the others. vLLM's ``enable_adaptive_verification`` (a bool) is
        taken as a second name for it.
    :param verify_passes: how many verify passes one engine step may run for a request that
        runs alone (Sonar's option; proposers that ``drafts_between_passes``, such as
        n-gram, or ``drafts_in_passes``, such as DFlash and DSpark). Each pass after the
        first drafts from what the pass before kept, without leaving the worker (on a GPU
        without waiting for the host), so the engine's own work between steps
        (scheduling, results, detokenizing) is paid once for several passes; the request
        must be greedy, without logprobs, penalties or a grammar, and nothing may wait to be
        admitted. 1 (the default): one pass a step, as in vLLM.
    :param extra: method-specific options, passed through untouched.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    verification: str | None = None
    verify_passes: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if self.verify_passes < 1:
            raise ValueError(f"speculative_config['verify_passes'] must be >= 1, got {self.verify_passes}")
        if self.verification is None:  # frozen: the resolved default is set once, here
            object.__setattr__(self, "verification", "confidence" if self.method in CONFIDENCE_BY_DEFAULT else "fixed")
        elif self.verification not in VERIFICATION_POLICIES:
            raise ValueError(
                f'speculative_config["verification"] must be "fixed" or "confidence", got {self.verification!r}'
            )

    @property
    def max_batch_size(self) -> int:
        """The most running requests a step may have and still carry drafts (no limit under
        confidence-scheduled verification unless ``disable_by_batch_size`` sets one)."""
        if self.disable_by_batch_size:
            return self.disable_by_batch_size
        return NO_BATCH_LIMIT if self.verification == "confidence" else DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any]) -> SpeculativeConfig:
        """A config from vLLM's dictionary (``{"method": "ngram", "num_speculative_tokens": 4}``);
        keys this class has no field for are kept in ``extra``. Without a ``method`` (or with
        ``"auto"``), a ``model`` folder's config.json names it (``sonar.spec_decode.detect``).

        :raises ValueError: not a dictionary, no ``method``, or a field of the wrong type.
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {name for name in cls.__dataclass_fields__ if name != "extra"}
        fields = {key: item for key, item in value.items() if key in known}
        extra = {key: item for key, item in value.items() if key not in known}
        if fields.get("method") in (None, "auto") and isinstance(fields.get("model"), str):
            from sonar.spec_decode.detect import detect_method

            fields["method"] = detect_method(fields["model"])  # from the drafter's config.json
        if not isinstance(fields.get("method"), str):
            raise ValueError('speculative_config needs a "method" (a string: "ngram", or a plugin\'s method)')
        fields.setdefault("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size", "verify_passes"):
            item = fields.get(name)
            if item is not None and (not isinstance(item, int) or isinstance(item, bool)):
                raise ValueError(f"speculative_config[{name!r}] must be an integer, got {item!r}")
        if fields.get("model") is not None and not isinstance(fields["model"], str):
            raise ValueError(f"speculative_config['model'] must be a string, got {fields['model']!r}")
        if "enable_adaptive_verification" in extra:  # vLLM's name for confidence-scheduled verification
            adaptive = extra.pop("enable_adaptive_verification")
            if not isinstance(adaptive, bool):
                raise ValueError(f"speculative_config['enable_adaptive_verification'] must be true or false, got {adaptive!r}")
            named = "confidence" if adaptive else "fixed"
            if fields.get("verification") not in (None, named):
                raise ValueError(
                    f"speculative_config: enable_adaptive_verification={str(adaptive).lower()} contradicts "
                    f"verification={fields['verification']!r} (give one of them)"
                )
            fields["verification"] = named
        if fields.get("verification") is not None and not isinstance(fields["verification"], str):
            raise ValueError(f'speculative_config["verification"] must be "fixed" or "confidence", got {fields["verification"]!r}')
        return cls(**fields, extra=extra)


@dataclass(slots=True)
class ProposerInputs:
    """One step's view of the requests that will be verified next.

    Rows follow ``req_ids``. ``token_ids[i]`` is request ``i``'s whole sequence so far (prompt
    and accepted output; host lists, for methods that look tokens up), ``num_accepted[i]``
    how many tokens the step that just ran accepted for it (1 + accepted drafts).
    ``hidden_states`` are the target model's states (its auxiliary layers' concatenated
    where the proposer chose some, else its last layer's) of the positions it computed for
    the request and kept since the last proposal: after a verify step its last known token
    and the accepted drafts (``num_accepted[i]`` rows), after a prefill every prompt token
    computed (chunks that sampled nothing included). ``num_hidden_states[i]`` rows per
    request, ``[sum(num_hidden_states), width]`` on the device in row order, ``positions``
    their positions; all three are None for methods with ``needs_hidden_states = False``.
    ``sampling[i]`` is request ``i``'s sampling state (its parameters and seeded generator),
    for drafters that sample from the request's own distribution.
    """

    req_ids: list[str]
    token_ids: list[list[int]]
    num_accepted: list[int]
    hidden_states: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    num_hidden_states: list[int] | None = None
    sampling: list[RequestSamplingState] | None = None


@dataclass(slots=True)
class DraftTokens:
    """The proposals of one step: ``token_ids[i]`` for request ``req_ids[i]``, at most
    ``num_speculative_tokens`` long (empty: nothing to propose, the request decodes plainly).
    ``probs[i]``, where given, is the draft distribution of each proposed token
    (``[len(token_ids[i]), vocab]``, on the device) for rejection sampling; None (the whole
    list, or one request's entry) means the drafts were picked greedily: they are then
    treated as one-hot.
    ``confidence[i]``, where given, is the proposer's estimate, per draft position ``j``, of
    the probability that drafts ``0..j`` of request ``i`` all survive verification (so it
    does not increase along the row); a verification policy that schedules by confidence
    reads it to verify only the prefix worth its cost (``sonar.spec_decode.verification``). None
    (the whole list, or one request's entry): no estimates; that policy then uses the
    engine's observed acceptance by position, and fixed verification verifies every draft."""

    req_ids: list[str]
    token_ids: list[list[int]]
    probs: list[torch.Tensor | None] | None = None
    confidence: list[list[float] | None] | None = None


@dataclass(slots=True)
class ChainedStep:
    """A verify step whose results are still on the device, for a proposer that ``chains``:
    it drafts the next step right behind the verification, before the host reads anything.

    Request ``req_ids[i]`` verified ``num_positions[i] - 1`` drafts; its positions are rows
    ``starts[i] .. starts[i] + num_positions[i] - 1`` of ``token_ids`` (the token emitted at
    each, valid up to its ``num_accepted[i] + 1``-th) and of ``hidden_states`` / ``positions``
    (the target's states of every verified position, the rows after a rejected draft
    included: they were computed from a wrong token and must not count as context).
    ``first_positions[i]`` is the sequence position of its first row (its last known token).
    ``token_ids``, ``num_accepted``, ``hidden_states`` and ``positions`` are on the device;
    the lists are the host's."""

    req_ids: list[str]
    num_positions: list[int]
    starts: list[int]
    first_positions: list[int]
    token_ids: torch.Tensor  # [P] int64
    num_accepted: torch.Tensor  # [B] int64
    hidden_states: torch.Tensor  # [P, width]
    positions: torch.Tensor  # [P] int64


@dataclass(slots=True)
class ChainedDrafts:
    """The drafts of a ``ChainedStep``, on the device: ``token_ids[i]`` (``[B, k]``) for its
    request ``i``, and the survival estimates ``confidence[i]`` where the proposer gives them
    (as ``DraftTokens.confidence``)."""

    token_ids: torch.Tensor
    confidence: torch.Tensor | None = None


@dataclass(slots=True)
class DraftCacheBudget:
    """What sizes a drafter's own cache: the target's block count and size and the engine's
    limits; ``capturer``: the platform's graph capturer where drafter passes are captured
    (None: they run eagerly)."""

    num_target_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    capturer: GraphCapturer | None = None


class Proposer:
    """Proposes draft tokens for the target model to verify. Subclass and register it.

    The worker builds it once, after the target model is loaded, calls ``load_model`` (a
    drafter may share the target's embedding or head: it gets the target module), then
    ``propose`` after every step that sampled.

    :cvar needs_hidden_states: whether ``propose`` reads the target's hidden states (the
        runner keeps them only then).
    :cvar keeps_context: whether the proposer keeps per-request context that only the
        target's states can build (a drafter's own KV cache over them): the runner then calls
        ``keep_context`` after every step that does not draft, so no position is missing when
        drafting resumes.
    :cvar chains: whether the proposer can draft from a verify step's device results
        (``propose_chained``): the runner then queues the drafter right behind the
        verification, and the host reads the step's tokens and the next drafts at once.
    :cvar drafts_between_passes: whether ``propose`` reads the requests' tokens alone (no
        hidden states, no cache of its own) and costs little host time, so that one step may
        run several verify passes, each drafting from the tokens the pass before kept
        (``SpeculativeConfig.verify_passes``).
    :cvar drafts_on_device: whether the proposer also drafts from a sequence held on the
        device (``propose_on_device``): a runner that keeps the passes' inputs on the device
        (the CUDA decode graphs) then queues every pass of a step without reading any back.
    :cvar drafts_in_passes: whether a proposer that ``chains`` also drafts between the verify
        passes of one step (``SpeculativeConfig.verify_passes``) from each pass's device
        results: the runner then reads each pass back and chains the next drafts behind it
        (``propose_chained``, settled pass by pass), or, where it keeps the passes' inputs on
        the device, queues every pass at once with ``begin_passes`` and ``propose_pass``.
    :param config: the speculative configuration.
    :param device: the worker's device.
    """

    needs_hidden_states: bool = False
    keeps_context: bool = False
    chains: bool = False
    drafts_between_passes: bool = False
    drafts_on_device: bool = False
    drafts_in_passes: bool = False

    def __init__(self, config: SpeculativeConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        """Refuse a configuration this method cannot run (a ValueError naming the field);
        called when the engine configuration is resolved, before anything loads."""

    def bind_runner(self, runner: ModelRunner) -> None:
        """Called once, just before ``load_model``, with the model runner that owns the
        proposer: a drafter with a model of its own builds it as the runner built the target
        (its dtype, attention backend and engine limits)."""

    def load_model(self, target_model: torch.nn.Module) -> None:
        """Load the drafter's weights (if any); ``target_model`` may lend it shared layers."""

    def cache_bytes_per_block(self, block_size: int) -> int:
        """Device bytes the drafter's own cache takes per target block of ``block_size``
        tokens (0: it keeps none); the runner adds them to the target's bytes per block, so
        one memory budget sizes both caches (``init_cache`` then gets the block count)."""
        return 0

    def init_cache(self, budget: DraftCacheBudget) -> None:
        """Allocate the drafter's own cache once the target's is sized (and capture its
        passes where ``budget.capturer`` is given); called after ``load_model``."""

    def remove_requests(self, req_ids: set[str]) -> None:
        """Drop any per-request state of these requests (finished, aborted or preempted)."""

    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        """Draft up to ``config.num_speculative_tokens`` tokens per request of ``inputs``."""
        raise NotImplementedError

    def propose_on_device(self, tokens: torch.Tensor, length: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft for one request from its sequence on the device (only where
        ``drafts_on_device``), without waiting for the device: ``tokens`` (int64 ``[C]``)
        holds the prompt and the outputs so far in its first ``length`` entries (a 0-d int64
        tensor, at most ``C - 1``); returns ``(drafts, count)``: int64 ``[k]`` whose first
        ``count`` (0-d int64, at most ``k``) are the drafts, the rest zero. The same drafts as
        ``propose`` would give for that sequence."""
        raise NotImplementedError

    def begin_passes(self, req_id: str, num_rows: int) -> bool:
        """Before the further passes of a step are queued on the device (only where
        ``drafts_in_passes``; after ``propose_chained`` for the step's first pass): make room
        in ``req_id``'s context for up to ``num_rows`` more positions, so that ``propose_pass``
        needs nothing from the host. False where there is none (the step then runs one pass)."""
        return False

    def propose_pass(
        self, req_id: str, states: torch.Tensor, positions: torch.Tensor, num_kept: torch.Tensor, anchor: torch.Tensor, anchor_position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft for a lone request between two verify passes queued on the device (only where
        ``drafts_in_passes``), from device values alone: nothing here may wait for the device.
        ``states`` / ``positions`` are the target's states of the pass just run, row by row
        (``[rows, width]``, ``[rows]``), of which the first ``num_kept`` (0-d int64; 0 for a
        pass that did not run) are kept context; ``anchor`` is the last token emitted and
        ``anchor_position`` its position (0-d int64). Returns the ``k`` drafts (int64 ``[k]``)
        and their survival estimates (``[k]``, or None). The host's length of the request is
        settled once, after the step (``settle_chained`` with every token the passes emitted
        after the first pass's last known token)."""
        raise NotImplementedError

    def keep_context(self, inputs: ProposerInputs) -> None:
        """Take a step's states into the requests' context without drafting (called only
        where ``keeps_context``): after a step whose batch was past ``max_batch_size``, one
        the scheduler chose not to draft for (confidence-scheduled verification), or for a
        request not yet allowed to draft (short of its ``min_tokens``). ``inputs`` are what
        ``propose`` would get, except that ``token_ids`` are read-only sequences (not lists);
        nothing may wait for the device here (the step after this one may be running)."""

    def propose_chained(self, step: ChainedStep) -> ChainedDrafts:
        """Draft ``config.num_speculative_tokens`` tokens per request of ``step`` (only where
        ``chains``) from device values alone: nothing here may wait for the device. Each
        request's context takes its kept positions only (``num_accepted[i] + 1`` rows); the
        runner calls ``settle_chained`` once the host knows how many that was."""
        raise NotImplementedError

    def settle_chained(self, req_ids: list[str], num_accepted: list[int]) -> None:
        """The host's side of the last ``propose_chained``, once its results are read back:
        request ``req_ids[i]`` kept ``num_accepted[i]`` drafts (a request removed meanwhile
        is absent or ignored)."""
