"""What the engine hands a speculative proposer each step, and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``speculative_config`` as users give it (vLLM's keys).

    :param method: the registered proposer (``"ngram"``, ``"eagle3"``, ``"dflash"``, ...).
    :param num_speculative_tokens: draft tokens proposed per request and step.
    :param model: the draft model's folder, for methods that run one.
    :param prompt_lookup_min: n-gram methods: the shortest suffix matched.
    :param prompt_lookup_max: n-gram methods: the longest suffix matched.
    :param extra: method-specific options, passed through untouched.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")


@dataclass(slots=True)
class ProposerInputs:
    """One step's view of the requests that will be verified next.

    Rows follow ``req_ids``. ``token_ids[i]`` is request ``i``'s whole sequence so far (prompt
    and accepted output; host lists, for methods that look tokens up), ``num_accepted[i]``
    how many tokens the step that just ran accepted for it (1 + accepted drafts).
    ``hidden_states`` are the target model's last-layer states of those accepted tokens,
    ``[sum(num_accepted), hidden]`` on the device, in row order, and ``positions`` their
    positions; both are None for methods that declare ``needs_hidden_states = False``.
    """

    req_ids: list[str]
    token_ids: list[list[int]]
    num_accepted: list[int]
    hidden_states: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@dataclass(slots=True)
class DraftTokens:
    """The proposals of one step: ``token_ids[i]`` for request ``req_ids[i]``, at most
    ``num_speculative_tokens`` long (empty: nothing to propose, the request decodes plainly).
    ``probs[i]``, where given, is the draft distribution of each proposed token
    (``[len(token_ids[i]), vocab]``) for rejection sampling; None means the drafts were picked
    greedily (they are then accepted only where the target agrees)."""

    req_ids: list[str]
    token_ids: list[list[int]]
    probs: list[torch.Tensor] | None = None


class Proposer:
    """Proposes draft tokens for the target model to verify. Subclass and register it.

    The worker builds it once, after the target model is loaded, calls ``load_model`` (a
    drafter may share the target's embedding or head: it gets the target module), then
    ``propose`` after every step that sampled.

    :cvar needs_hidden_states: whether ``propose`` reads the target's hidden states (the
        runner keeps them only then).
    :param config: the speculative configuration.
    :param device: the worker's device.
    """

    needs_hidden_states: bool = False

    def __init__(self, config: SpeculativeConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    def load_model(self, target_model: torch.nn.Module) -> None:
        """Load the drafter's weights (if any); ``target_model`` may lend it shared layers."""

    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        """Draft up to ``config.num_speculative_tokens`` tokens per request of ``inputs``."""
        raise NotImplementedError
