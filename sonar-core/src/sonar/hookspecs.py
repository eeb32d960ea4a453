"""Sonar's plugin interfaces, as pluggy hookspecs.

A plugin is a module (or object) whose functions carry the ``@hookimpl`` marker and are named
after the specs below. Sonar discovers plugin modules from the ``sonar.plugins`` entry-point
group and registers each into one pluggy ``PluginManager`` (see ``sonar.plugins``). First-party
packages (sonar-cpu, sonar-models, sonar-server) register exactly this way.

Registration hooks take a ``register`` callback; call it once per thing you provide. An
implementation may accept fewer arguments than its spec: specs grow, they don't break.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

PROJECT_NAME = "sonar"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# ---------------------------------------------------------------------------------------------
# Platforms
# ---------------------------------------------------------------------------------------------


@hookspec
def sonar_register_platforms(register: Callable[..., None]) -> None:
    """Register hardware platforms.

    Call ``register(name, detect)`` for each platform, where:

    :param register: ``register(name: str, detect: Callable[[], str | None])``. ``name`` is the
        short platform name users pass in ``SONAR_PLATFORM`` (``"cpu"``, ``"cuda"``).
        ``detect()`` must be cheap and import nothing heavy: it returns the dotted path
        ``"package.module:PlatformClass"`` of a ``sonar.platform.Platform`` subclass when its
        hardware is present, or None (logging at debug level why not).
    """


# ---------------------------------------------------------------------------------------------
# Models and weights
# ---------------------------------------------------------------------------------------------


@hookspec
def sonar_register_models(register: Callable[..., None]) -> None:
    """Register model architectures.

    :param register: ``register(architecture: str, class_path: str)``. ``architecture`` is the
        name found in a Hugging Face ``config.json`` ``architectures`` list
        (``"LlamaForCausalLM"``); ``class_path`` is ``"package.module:ClassName"`` of a
        ``torch.nn.Module`` following ``sonar.model_interface.CausalLM``. The class is imported
        only when a model of that architecture is loaded.
    """


@hookspec
def sonar_register_weight_formats(register: Callable[..., None]) -> None:
    """Register checkpoint formats (how a model path becomes a config, a tokenizer and weights).

    :param register: ``register(name: str, fmt: sonar.model_interface.WeightFormat)``. The
        engine asks each format in registration order whether it ``detect``\\ s the model path;
        ``load_format=name`` forces one (``"dummy"`` builds random weights from a config alone).
    """


@hookspec
def sonar_register_quantization_methods(register: Callable[..., None]) -> None:
    """Register quantization methods (how quantized checkpoint tensors map to runtime tensors and
    which linear layer runs them).

    :param register: ``register(name: str, method: type[sonar.quantization.QuantizationMethod] | str)``
        (the class or its ``"module:Class"`` path); ``name`` is what users pass as
        ``quantization=`` and what checkpoints carry in ``quantization_config.quant_method``.
    """


# ---------------------------------------------------------------------------------------------
# Engine parts
# ---------------------------------------------------------------------------------------------


@hookspec
def sonar_register_scheduler_policies(register: Callable[..., None]) -> None:
    """Register scheduling policies (``scheduling_policy=`` / ``--scheduling-policy NAME``).

    :param register: ``register(name: str, policy: str | type)``. ``policy`` is a
        ``sonar.engine.scheduling_policy.SchedulingPolicy`` subclass or its
        ``"package.module:Class"`` path. The policy orders the waiting queue and picks the
        running request to preempt when KV blocks run out; Sonar's own ``fcfs`` and
        ``priority`` register through this hook.
    """


@hookspec
def sonar_register_kv_cache_managers(register: Callable[..., None]) -> None:
    """Register KV-cache managers (``kv_cache_manager=`` / ``--kv-cache-manager NAME``).

    :param register: ``register(name: str, manager: str | type)``. ``manager`` is a
        ``sonar.engine.kv_cache.KVCacheManager`` subclass (or its path) built from the engine's
        block count, block size, prefix-caching switch and the model's per-layer
        ``KVCacheSpec`` list; Sonar's ``paged`` manager is the default.
    """


@hookspec
def sonar_register_executors(register: Callable[..., None]) -> None:
    """Register executors (``distributed_executor_backend=`` /
    ``--distributed-executor-backend NAME``): what runs the workers of one engine core.

    :param register: ``register(name: str, executor: str | type)``. ``executor`` is a
        ``sonar.executor.Executor`` subclass or its path; Sonar's ``uni`` runs one worker in
        the engine core's own process.
    """


@hookspec
def sonar_register_speculative_proposers(register: Callable[..., None]) -> None:
    """Register speculative-decoding proposers (``speculative_config={"method": NAME, ...}``).

    :param register: ``register(method: str, proposer: str | type)``. ``proposer`` is a
        ``sonar.spec_decode.Proposer`` subclass or its path: given the step's accepted tokens it
        proposes draft tokens per request, which the target model verifies in the next step.
    """


@hookspec
def sonar_register_kv_connectors(register: Callable[..., None]) -> None:
    """Register KV connectors (``kv_transfer_config={"kv_connector": NAME, ...}``): moving KV
    blocks between an engine and something outside it (another engine, host memory, storage).

    :param register: ``register(name: str, connector: str | type)``. ``connector`` is a
        ``sonar.kv_transfer.KVConnector`` subclass or its path; it has a scheduler side (which
        tokens of a request are available outside, and where their blocks go) and a worker
        side (loading and saving the blocks around each step).
    """


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


@hookspec
def sonar_register_logits_processors(register: Callable[..., None]) -> None:
    """Register batch-level logits processors.

    :param register: ``register(name: str, factory: Callable[[], sonar.sampler.LogitsProcessor])``.
        A processor is applied in the sampler to the rows of the requests that name it in
        ``SamplingParams.logits_processors``; a batch where nobody names it pays nothing.
    """


@hookspec
def sonar_register_sampler_stages(register: Callable[..., None]) -> None:
    """Register sampler stages (steps that edit a batch of logits, in an order requests may change).

    :param register: ``register(stage)``. ``stage`` is a ``sonar.sampler.SamplerStage``
        instance, subclass or ``"package.module:Name"`` path. It names itself, says where it
        runs in the default order (``rank``, ``after`` or ``before``), declares its request
        parameters (namespaced keys of ``SamplingParams.extra_args``) and builds its tensors
        only for steps where some request uses it; Sonar's own stages register through this hook.
    """


# ---------------------------------------------------------------------------------------------
# Packages' own hookspecs
# ---------------------------------------------------------------------------------------------


@hookspec(historic=True)
def sonar_add_hookspecs(manager: pluggy.PluginManager) -> None:
    """Add a package's own hookspecs to the plugin manager (as pytest's ``pytest_addhooks``).

    Called once for every plugin, as it is registered, so a package defines hooks for its own
    concepts (sonar-server: API surfaces, tool-call and reasoning parsers) without sonar-core
    naming them.

    :param manager: the plugin manager; call ``manager.add_hookspecs(module)``.
    """


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


@hookspec
def sonar_register_cli_commands(register: Callable[..., None]) -> None:
    """Register ``sonar`` subcommands (sonar-core's own ``chat``, ``generate``, ``bench`` and
    ``plugins`` come through this hook too; sonar-server adds ``serve`` and ``bench serve``).

    :param register: ``register(name: str, add_parser: str | Callable)``. ``name`` is the
        command as typed, ``"serve"``, or a subcommand of one, ``"bench serve"``.
        ``add_parser(subparsers)`` (or its ``"package.module:function"`` path) adds the command
        to the ``argparse`` subparsers it is given and returns the parser it added, with
        ``func`` set as a default; it runs on every ``sonar`` invocation, so it imports nothing
        heavy (the command's ``func`` imports what it needs).
    """
