"""The engine-part hooks: what a plugin registers is what the registry resolves, and the
engine's own parts come through the same hooks."""

from __future__ import annotations

import pytest

from sonar import registry
from sonar.hookspecs import hookimpl
from sonar.kv_transfer import KVConnector, KVConnectorRole, KVTransferConfig
from sonar.plugins import get_plugin_manager
from sonar.spec_decode import DraftTokens, Proposer, ProposerInputs, SpeculativeConfig


class EchoProposer(Proposer):
    """Proposes the request's last token again."""

    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        k = self.config.num_speculative_tokens
        return DraftTokens(inputs.req_ids, [tokens[-1:] * k for tokens in inputs.token_ids])


class CountingConnector(KVConnector):
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 16, False


class _Plugin:
    @hookimpl
    def sonar_register_speculative_proposers(self, register) -> None:
        register("echo", EchoProposer)

    @hookimpl
    def sonar_register_kv_connectors(self, register) -> None:
        register("counting", "test_engine_hooks:CountingConnector")


@pytest.fixture
def plugin():
    manager = get_plugin_manager()
    manager.register(_Plugin(), name="test-engine-hooks")
    registry.clear_caches()
    try:
        yield
    finally:
        manager.unregister(name="test-engine-hooks")
        registry.clear_caches()


def test_core_parts_are_registered_through_the_hooks() -> None:
    assert {"fcfs", "priority"} <= set(registry.scheduler_policies())
    assert "paged" in registry.kv_cache_managers()
    assert "uni" in registry.executors()
    from sonar.engine.kv_cache import KVCacheManager
    from sonar.executor.uniproc import UniprocExecutor

    assert registry.load_registered("executor", "uni", registry.executors()) is UniprocExecutor
    assert registry.load_registered("KV-cache manager", "paged", registry.kv_cache_managers()) is KVCacheManager


def test_a_plugin_proposer_and_connector_resolve(plugin) -> None:
    proposer_cls = registry.load_registered("proposer", "echo", registry.speculative_proposers())
    proposer = proposer_cls(SpeculativeConfig("echo", 2), device=None)
    drafts = proposer.propose(ProposerInputs(["a", "b"], [[1, 2, 3], [9]], [1, 1]))
    assert drafts.token_ids == [[3, 3], [9, 9]]
    connector_cls = registry.load_registered("KV connector", "counting", registry.kv_connectors())
    connector = connector_cls(KVTransferConfig("counting", "kv_consumer"), KVConnectorRole.SCHEDULER)
    assert connector.get_num_new_matched_tokens(None, 0) == (16, False)
    assert connector.request_finished(None, [1, 2]) == (False, None)  # the base: nothing held back


def test_unknown_names_and_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="'lookahead' is not registered"):
        registry.load_registered("proposer", "lookahead", registry.speculative_proposers())
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig("x", kv_role="sender")


def test_engine_options_name_registered_parts(tmp_path) -> None:
    from sonar.config import EngineArgs
    from sonar.engine.resolve import resolve_engine_config
    from sonar.platform import current_platform
    from sonar_models.testing import build_tiny_model

    build_tiny_model("llama", tmp_path)
    config, _ = resolve_engine_config(EngineArgs(model=str(tmp_path), scheduling_policy="priority"), current_platform())
    assert (config.scheduling_policy, config.kv_cache_manager, config.executor) == ("priority", "paged", "uni")
    with pytest.raises(ValueError, match="distributed_executor_backend='ray' is not registered; registered: mp, uni"):
        resolve_engine_config(EngineArgs(model=str(tmp_path), distributed_executor_backend="ray"), current_platform())
    with pytest.raises(ValueError, match="kv_cache_manager='tiered' is not registered"):
        resolve_engine_config(EngineArgs(model=str(tmp_path), kv_cache_manager="tiered"), current_platform())
