"""Resolving ``kv_transfer_config`` / ``kv_offload_bytes`` and building a connector's halves."""

from __future__ import annotations

import dataclasses
from typing import Any

from sonar.kv_transfer.interface import KVCacheLayout, KVConnector, KVConnectorRole, KVTransferConfig

OFFLOADING_CONNECTOR = "OffloadingConnector"


def resolve_kv_transfer_config(
    value: dict[str, Any] | KVTransferConfig | None, kv_offload_bytes: int = 0, kv_transfer_timeout: float | None = None
) -> KVTransferConfig | None:
    """The engine's connector configuration: ``kv_transfer_config`` as given, or, with only
    ``kv_offload_bytes``, the host offload connector with that budget.

    ``kv_transfer_timeout`` (``--kv-transfer-timeout``) goes into the config's
    ``kv_connector_extra_config["kv_transfer_timeout"]``, where it may also be given directly.

    :raises ValueError: a malformed config, a connector that is not registered (the message
        lists those that are), both options at once, a timeout without a ``kv_transfer_config``,
        or a timeout given both ways with different values.
    """
    from sonar.registry import kv_connectors

    if value is None and kv_transfer_timeout is not None:
        raise ValueError("kv_transfer_timeout applies to a kv_transfer_config's transfers between engines: give --kv-transfer-config too")
    if value is None and not kv_offload_bytes:
        return None
    if value is not None and kv_offload_bytes:
        raise ValueError(
            "kv_offload_bytes and kv_transfer_config cannot be combined yet: the host offload tier is a connector "
            f"of its own ({OFFLOADING_CONNECTOR}); give one of them"
        )
    if value is None:
        value = {"kv_connector": OFFLOADING_CONNECTOR, "kv_connector_extra_config": {"kv_offload_bytes": kv_offload_bytes}}
    config = KVTransferConfig.from_value(value)
    if kv_transfer_timeout is not None:
        config = _with_timeout(config, kv_transfer_timeout)
    registered = kv_connectors()
    if config.kv_connector not in registered:
        raise ValueError(
            f"kv_transfer_config: connector {config.kv_connector!r} is not registered; registered: "
            f"{', '.join(sorted(registered))} (install the plugin that provides it)"
        )
    connector_cls = _connector_class(config.kv_connector)
    connector_cls.check_config(config)
    return config


def _with_timeout(config: KVTransferConfig, timeout: float) -> KVTransferConfig:
    extra = dict(config.kv_connector_extra_config)
    given = extra.get("kv_transfer_timeout")
    if given is not None and given != timeout:
        raise ValueError(
            f"kv_transfer_timeout={timeout} and kv_transfer_config's kv_connector_extra_config['kv_transfer_timeout']={given!r} "
            "disagree; give one of them"
        )
    extra["kv_transfer_timeout"] = timeout
    return dataclasses.replace(config, kv_connector_extra_config=extra)


def _connector_class(name: str) -> type[KVConnector]:
    from sonar.registry import kv_connectors, load_registered

    return load_registered("KV connector", name, kv_connectors())


def build_kv_connector(config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout) -> KVConnector:
    """One half of the configured connector."""
    return _connector_class(config.kv_connector)(config, role, layout)
