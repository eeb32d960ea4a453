"""KV connectors: moving KV blocks between an engine and something outside it (another engine
for prefill/decode disaggregation, host memory, a storage tier).

A connector has two halves that talk through plain data: on the scheduler side it tells the
scheduler which of a request's tokens already exist outside (so they are loaded instead of
computed) and builds, each step, the metadata that says which blocks to load and save; on the
worker side it moves those blocks around the model's forward. Connectors are registered
through ``sonar_register_kv_connectors`` and selected with
``kv_transfer_config={"kv_connector": NAME, ...}``.
"""

from sonar.kv_transfer.interface import KVConnector, KVConnectorMetadata, KVConnectorRole, KVTransferConfig

__all__ = ["KVConnector", "KVConnectorMetadata", "KVConnectorRole", "KVTransferConfig"]
