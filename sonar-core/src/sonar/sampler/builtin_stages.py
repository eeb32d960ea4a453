"""Sonar's own sampler stages, registered through ``sonar_register_sampler_stages`` like any
plugin's. Their options are ``SamplingParams``' own fields; their ids are Aphrodite's
(``SamplerID``); their ranks give the default order DRY → penalties and logits processors →
no-repeat-ngram → temperature/dynatemp → top-nσ → top-k/top-p → top-a → min-p → TFS → eta →
epsilon → typical-p → smoothing → XTC, with mirostat after them all."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from sonar.sampler.dry import apply_dry, apply_no_repeat_ngram, build_dry, build_no_repeat_ngram
from sonar.sampler.mirostat import MirostatTensors, apply_mirostat, update_mirostat
from sonar.sampler.penalties import PenaltyTensors, apply_penalties, build_penalties
from sonar.sampler.rows import RowValues, row_values
from sonar.sampler.sampler_ids import SamplerID
from sonar.sampler.shaping import apply_quadratic
from sonar.sampler.stage import SamplerStage, StageContext
from sonar.sampler.temperature import apply_dynatemp, apply_temperature
from sonar.sampler.topk_topp import apply_min_p, apply_top_k_top_p
from sonar.sampler.truncation import (
    apply_epsilon_cutoff,
    apply_eta_cutoff,
    apply_tfs,
    apply_top_a,
    apply_top_nsigma,
    apply_typical_p,
)
from sonar.sampler.xtc import XtcTensors, run_xtc
from sonar.tensors import to_device

if TYPE_CHECKING:
    from sonar.sampler.metadata import RequestSamplingState
    from sonar.sampling_params import SamplingParams

States = list["RequestSamplingState"]


# -- penalty-like: greedy rows too -------------------------------------------------------------


class DryStage(SamplerStage):
    name, sampler_id, rank = "dry", SamplerID.DRY, 100
    covers_greedy = reads_output_tokens = True

    def uses(self, params: SamplingParams) -> bool:
        return params.uses_dry

    def build(self, states: States, rows: list[int], vocab_size: int, device: torch.device) -> Any:
        return build_dry(states, rows, vocab_size, device)

    def apply(self, logits: torch.Tensor, tensors: Any, context: StageContext) -> torch.Tensor:
        return apply_dry(logits, tensors)


class PenaltiesStage(SamplerStage):
    """Repetition, presence and frequency penalties, then the registered logits processors the
    rows name (in ``SamplingParams.logits_processors``)."""

    name, sampler_id, rank = "penalties", SamplerID.PENALTIES, 200
    aliases = ("repetition_penalty",)
    covers_greedy = reads_output_tokens = True

    def uses(self, params: SamplingParams) -> bool:
        return (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or bool(params.logits_processors)
        )

    def build(self, states: States, rows: list[int], vocab_size: int, device: torch.device) -> Any:
        processor_rows: dict[str, list[int]] = {}  # processor name -> rows naming it
        for row in rows:
            for name in states[row].params.logits_processors:
                processor_rows.setdefault(name, []).append(row)
        return build_penalties(states, vocab_size, device), processor_rows

    def apply(self, logits: torch.Tensor, tensors: Any, context: StageContext) -> torch.Tensor:
        penalties: PenaltyTensors | None
        penalties, processor_rows = tensors
        if penalties is not None:
            logits = apply_penalties(logits, penalties)
        for name, rows in processor_rows.items():
            processor = context.logits_processor(name)
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            states = [context.states[row] for row in rows]
            batch_rows = [context.batch_rows[row] for row in rows]
            logits[index] = processor(logits[index], batch_rows, states).to(logits.dtype)
        return logits


class NoRepeatNgramStage(SamplerStage):
    name, sampler_id, rank = "no_repeat_ngram", SamplerID.NO_REPEAT_NGRAM, 300
    covers_greedy = reads_output_tokens = True

    def uses(self, params: SamplingParams) -> bool:
        return params.no_repeat_ngram_size > 0

    def build(self, states: States, rows: list[int], vocab_size: int, device: torch.device) -> Any:
        return build_no_repeat_ngram(states, rows, vocab_size, device)

    def apply(self, logits: torch.Tensor, tensors: Any, context: StageContext) -> torch.Tensor:
        return apply_no_repeat_ngram(logits, tensors)


# -- distribution-shaping: random rows only -----------------------------------------------------


class TemperatureStage(SamplerStage):
    """A static temperature, or DynaTemp's entropy-based one when ``dynatemp_max > 0``."""

    name, sampler_id, rank = "temperature", SamplerID.TEMPERATURE, 400
    aliases = ("dynatemp",)

    def uses(self, params: SamplingParams) -> bool:
        return params.temperature != 1.0 or params.uses_dynatemp

    def build(self, states: States, rows: list[int], vocab_size: int, device: torch.device) -> Any:
        static = [row for row in rows if not states[row].params.uses_dynatemp]
        dynamic = [row for row in rows if states[row].params.uses_dynatemp]
        num_rows = len(states)
        temperature = row_values(static, [(states[r].params.temperature,) for r in static], num_rows, device) if static else None
        dynatemp = None
        if dynamic:
            options = [(p.dynatemp_min, p.dynatemp_max, p.dynatemp_exponent) for p in (states[r].params for r in dynamic)]
            dynatemp = row_values(dynamic, options, num_rows, device)
        return temperature, dynatemp

    def apply(self, logits: torch.Tensor, tensors: Any, context: StageContext) -> torch.Tensor:
        temperature, dynatemp = tensors
        if temperature is not None:
            logits = temperature.apply(logits, apply_temperature)
        if dynatemp is not None:
            logits = dynatemp.apply(logits, apply_dynatemp)
        return logits


class TopKTopPStage(SamplerStage):
    name, sampler_id, rank = "top_p_top_k", SamplerID.TOP_P_TOP_K, 600
    aliases = ("top_k", "top_p")

    def uses(self, params: SamplingParams) -> bool:
        return params.top_k > 0 or params.top_p < 1.0

    def build(self, states: States, rows: list[int], vocab_size: int, device: torch.device) -> Any:
        # full-batch tensors with neutral values
        top_k, top_p = [vocab_size] * len(states), [1.0] * len(states)
        for row in rows:
            params = states[row].params
            if params.top_k > 0:
                top_k[row] = min(params.top_k, vocab_size)
            top_p[row] = params.top_p
        on_top_k = [k for k in top_k if k < vocab_size]
        k = to_device(torch.tensor(top_k, dtype=torch.int64), device) if on_top_k else None
        p = None if all(value >= 1.0 for value in top_p) else to_device(torch.tensor(top_p, dtype=torch.float32), device)
        return None if k is None and p is None else (k, max(on_top_k, default=0), p)

    def apply(self, logits: torch.Tensor, tensors: Any, context: StageContext) -> torch.Tensor:
        return apply_top_k_top_p(logits, *tensors)


class MinPStage(SamplerStage):
    name, sampler_id, rank = "min_p", SamplerID.MIN_P, 800

    def uses(self, params: SamplingParams) -> bool:
        return params.min_p > 0.0

    def build(self, states: States, rows: list[int], vocab_size: int, device: torch.device) -> Any:
        min_p = [0.0] * len(states)
        for row in rows:
            min_p[row] = states[row].params.min_p
        return to_device(torch.tensor(min_p, dtype=torch.float32), device)

    def apply(self, logits: torch.Tensor, tensors: Any, context: StageContext) -> torch.Tensor:
        return apply_min_p(logits, tensors)


class RowOptionsStage(SamplerStage):
    """A stage whose rows each pass a few float options to one kernel ``kernel(logits, *options)``
    (``[R, V]`` logits and ``[R]`` tensors), run on the rows that use it."""

    kernel: ClassVar[Callable[..., torch.Tensor]]

    def options(self, params: SamplingParams) -> tuple[float, ...]:
        raise NotImplementedError

    def build(self, states: States, rows: list[int], vocab_size: int, device: torch.device) -> Any:
        return row_values(rows, [self.options(states[row].params) for row in rows], len(states), device)

    def apply(self, logits: torch.Tensor, tensors: RowValues, context: StageContext) -> torch.Tensor:
        return tensors.apply(logits, type(self).kernel)


class TopNSigmaStage(RowOptionsStage):
    name, sampler_id, rank = "top_nsigma", SamplerID.TOP_NSIGMA, 500
    aliases = ("nsigma",)
    kernel = staticmethod(apply_top_nsigma)

    def uses(self, params: SamplingParams) -> bool:
        return params.nsigma > 0.0

    def options(self, params: SamplingParams) -> tuple[float, ...]:
        return (params.nsigma,)


class TopAStage(RowOptionsStage):
    name, sampler_id, rank = "top_a", SamplerID.TOP_A, 700
    kernel = staticmethod(apply_top_a)

    def uses(self, params: SamplingParams) -> bool:
        return params.top_a > 0.0

    def options(self, params: SamplingParams) -> tuple[float, ...]:
        return (params.top_a,)


class TfsStage(RowOptionsStage):
    name, sampler_id, rank = "tfs", SamplerID.TFS, 900
    kernel = staticmethod(apply_tfs)

    def uses(self, params: SamplingParams) -> bool:
        return params.tfs < 1.0

    def options(self, params: SamplingParams) -> tuple[float, ...]:
        return (params.tfs,)


class EtaCutoffStage(RowOptionsStage):
    name, sampler_id, rank = "eta_cutoff", SamplerID.ETA_CUTOFF, 1000
    kernel = staticmethod(apply_eta_cutoff)

    def uses(self, params: SamplingParams) -> bool:
        return params.eta_cutoff > 0.0

    def options(self, params: SamplingParams) -> tuple[float, ...]:
        return (params.eta_cutoff,)


class EpsilonCutoffStage(RowOptionsStage):
    name, sampler_id, rank = "epsilon_cutoff", SamplerID.EPSILON_CUTOFF, 1100
    kernel = staticmethod(apply_epsilon_cutoff)

    def uses(self, params: SamplingParams) -> bool:
        return params.epsilon_cutoff > 0.0

    def options(self, params: SamplingParams) -> tuple[float, ...]:
        return (params.epsilon_cutoff,)


class TypicalPStage(RowOptionsStage):
    name, sampler_id, rank = "typical_p", SamplerID.TYPICAL_P, 1200
    aliases = ("typical",)
    kernel = staticmethod(apply_typical_p)

    def uses(self, params: SamplingParams) -> bool:
        return params.typical_p < 1.0

    def options(self, params: SamplingParams) -> tuple[float, ...]:
        return (params.typical_p,)


class QuadraticStage(RowOptionsStage):
    name, sampler_id, rank = "quadratic", SamplerID.QUADRATIC, 1300
    aliases = ("smoothing",)
    kernel = staticmethod(apply_quadratic)

    def uses(self, params: SamplingParams) -> bool:
        return params.smoothing_factor > 0.0

    def options(self, params: SamplingParams) -> tuple[float, ...]:
        return (params.smoothing_factor, params.smoothing_curve)


class XtcStage(SamplerStage):
    """XTC; each row's coin comes from its own generator when the request is seeded."""

    name, sampler_id, rank = "xtc", SamplerID.XTC, 1400

    def uses(self, params: SamplingParams) -> bool:
        return params.xtc_probability > 0.0

    def build(self, states: States, rows: list[int], vocab_size: int, device: torch.device) -> Any:
        options = [(states[row].params.xtc_threshold, states[row].params.xtc_probability) for row in rows]
        values = row_values(rows, options, len(states), device)
        return XtcTensors(values=values, generators=[states[row].generator for row in rows])

    def apply(self, logits: torch.Tensor, tensors: Any, context: StageContext) -> torch.Tensor:
        return run_xtc(logits, tensors)


# -- after the ordered stages ------------------------------------------------------------------


class MirostatStage(SamplerStage):
    """Mirostat v1/v2; each request's running threshold mu lives in its sampling state and is
    updated from the probability of the token it drew."""

    name, rank, final = "mirostat", 100, True

    def uses(self, params: SamplingParams) -> bool:
        return params.mirostat_mode != 0

    def build(self, states: States, rows: list[int], vocab_size: int, device: torch.device) -> Any:
        columns = []
        for row in rows:
            state, p = states[row], states[row].params
            mu = 2.0 * p.mirostat_tau if state.mirostat_mu is None else state.mirostat_mu
            columns.append((float(p.mirostat_mode), p.mirostat_tau, p.mirostat_eta, mu))
        values = row_values(rows, columns, len(states), device)
        return MirostatTensors(values=values, states=[states[row] for row in rows])

    def apply(self, logits: torch.Tensor, tensors: Any, context: StageContext) -> torch.Tensor:
        mode, _, _, mu = tensors.values.values
        return tensors.values.apply(logits, lambda sub, *_: apply_mirostat(sub, mode, mu))

    def on_sampled(self, tensors: Any, probs: torch.Tensor, sampled: torch.Tensor) -> None:
        rows = tensors.values.index
        chosen = probs.gather(1, sampled.unsqueeze(1)).squeeze(1)
        update_mirostat(tensors, chosen if rows is None else chosen[rows])

