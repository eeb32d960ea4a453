"""Name → implementation lookups built from the registration hooks."""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

from sonar.plugins import collect


def import_class(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def _by_name(hook_name: str) -> Callable[[], dict[str, Any]]:
    """A cached ``name -> registered thing`` lookup over a ``register(name, thing)`` hook."""

    @functools.cache
    def lookup() -> dict[str, Any]:
        return {name: target for name, target in collect(hook_name)}

    lookup.__name__ = hook_name.removeprefix("sonar_register_")
    return lookup


model_architectures = _by_name("sonar_register_models")  # architecture -> "package.module:Class"
weight_formats = _by_name("sonar_register_weight_formats")
quantization_methods = _by_name("sonar_register_quantization_methods")
logits_processors = _by_name("sonar_register_logits_processors")
scheduler_policies = _by_name("sonar_register_scheduler_policies")
kv_cache_managers = _by_name("sonar_register_kv_cache_managers")
executors = _by_name("sonar_register_executors")
speculative_proposers = _by_name("sonar_register_speculative_proposers")  # method -> proposer
kv_connectors = _by_name("sonar_register_kv_connectors")


@functools.cache
def sampler_stages() -> Any:
    """The registered sampler stages, ordered: a ``sonar.sampler.stage_table.StageTable``."""
    from sonar.sampler.stage_table import build_stage_table

    return build_stage_table([args[0] for args in collect("sonar_register_sampler_stages")])


def load_registered(kind: str, name: str, registered: dict[str, Any]) -> Any:
    """The class registered as ``name`` (imported here when registered as a path)."""
    if name not in registered:
        raise ValueError(f"{kind} {name!r} is not registered; registered: {sorted(registered)} (install the plugin that provides it)")
    target = registered[name]
    return import_class(target) if isinstance(target, str) else target


def architecture_of(hf_config: Any) -> str:
    """The registered architecture that runs ``hf_config``: the first of its ``architectures``
    list that is registered, or, for a config saved without that list (a bare
    ``Qwen3Config()``), the causal-LM class transformers' auto classes map its ``model_type`` to.

    :raises ValueError: no registered architecture runs it (the message lists those that are).
    """
    known = model_architectures()
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in known:
            return arch
    model_type = getattr(hf_config, "model_type", None)
    if not architectures and model_type:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if arch in known:
            return arch
    named = architectures or f"model_type {model_type!r}"
    raise ValueError(
        f"model architectures {named} are not supported; "
        f"registered architectures: {sorted(known)} (install a plugin that provides one)"
    )


def resolve_model_class(hf_config: Any) -> type:
    """The model class registered for ``hf_config``'s architecture (see ``architecture_of``)."""
    return import_class(model_architectures()[architecture_of(hf_config)])


def clear_caches() -> None:
    for fn in (
        model_architectures, weight_formats, quantization_methods, logits_processors, scheduler_policies,
        kv_cache_managers, executors, speculative_proposers, kv_connectors, sampler_stages,
    ):  # fmt: skip
        fn.cache_clear()
