"""Sonar core's own parts, registered through the same hooks a third-party plugin uses (the
plugin manager registers this module before any entry point, so ``SONAR_PLUGINS`` cannot
leave the engine without its scheduler)."""

from __future__ import annotations

from typing import Callable

from sonar.hookspecs import hookimpl


@hookimpl
def sonar_register_scheduler_policies(register: Callable[..., None]) -> None:
    register("fcfs", "sonar.engine.scheduling_policy:FcfsPolicy")
    register("priority", "sonar.engine.scheduling_policy:PriorityPolicy")


@hookimpl
def sonar_register_kv_cache_managers(register: Callable[..., None]) -> None:
    register("paged", "sonar.engine.kv_cache:KVCacheManager")


@hookimpl
def sonar_register_executors(register: Callable[..., None]) -> None:
    register("uni", "sonar.executor.uniproc:UniprocExecutor")
    register("mp", "sonar.executor.multiproc:MultiprocExecutor")


@hookimpl
def sonar_register_speculative_proposers(register: Callable[..., None]) -> None:
    register("ngram", "sonar.spec_decode.ngram:NgramProposer")
    register("eagle3", "sonar.spec_decode.eagle3:Eagle3Proposer")
    register("draft_model", "sonar.spec_decode.draft_model:DraftModelProposer")
    register("draft", "sonar.spec_decode.draft_model:DraftModelProposer")  # vLLM's older name
    register("dflash", "sonar.spec_decode.dflash:DFlashProposer")
    register("dspark", "sonar.spec_decode.dflash:DSparkProposer")


@hookimpl
def sonar_register_quantization_methods(register: Callable[..., None]) -> None:
    register("unquantized", "sonar.quantization:UnquantizedMethod")
    register("gptq", "sonar.quantization.gptq:GPTQMethod")
    register("awq", "sonar.quantization.awq:AWQMethod")
    register("fp8", "sonar.quantization.fp8:Fp8Method")
    register("compressed-tensors", "sonar.quantization.compressed_tensors:CompressedTensorsMethod")


@hookimpl
def sonar_register_kv_connectors(register: Callable[..., None]) -> None:
    register("OffloadingConnector", "sonar.kv_transfer.offload:OffloadingConnector")
    register("SonarConnector", "sonar.kv_transfer.sonar_connector:SonarConnector")
    register("NixlConnector", "sonar.kv_transfer.nixl_connector:NixlConnector")


@hookimpl
def sonar_register_cli_commands(register: Callable[..., None]) -> None:
    register("chat", "sonar.cli.chat:add_parser")
    register("generate", "sonar.cli.generate:add_parser")
    register("bench", "sonar.cli.bench:add_parser")
    register("train-drafter", "sonar.cli.train_drafter:add_parser")
    register("plugins", "sonar.cli.plugins:add_parser")


_BUILTIN_SAMPLER_STAGES = (
    "DryStage", "PenaltiesStage", "NoRepeatNgramStage", "TemperatureStage", "TopNSigmaStage", "TopKTopPStage",
    "TopAStage", "MinPStage", "TfsStage", "EtaCutoffStage", "EpsilonCutoffStage", "TypicalPStage", "QuadraticStage",
    "XtcStage", "MirostatStage",
)  # fmt: skip


@hookimpl
def sonar_register_sampler_stages(register: Callable[..., None]) -> None:
    for name in _BUILTIN_SAMPLER_STAGES:
        register(f"sonar.sampler.builtin_stages:{name}")
