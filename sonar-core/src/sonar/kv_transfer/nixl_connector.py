"""``NixlConnector`` (vLLM's name): prefill/decode transfers over NIXL, where ``nixl`` is installed.

Only its configuration check exists so far: a ``kv_transfer_config`` naming it is refused at
startup with a message saying what to install, or, where ``nixl`` is installed, that Sonar's
NIXL transport is not built yet. ``SonarConnector`` has the same semantics over TCP.
"""

from __future__ import annotations

import importlib.util

from sonar.kv_transfer.interface import KVConnector, KVTransferConfig


class NixlConnector(KVConnector):
    """Refused at startup for now (see the module's description)."""

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        if importlib.util.find_spec("nixl") is None:
            raise ValueError(
                "kv_connector 'NixlConnector' needs the nixl package, which is not installed here "
                "(pip install nixl, on hosts with its UCX transports); 'SonarConnector' needs nothing installed"
            )
        raise ValueError(
            "kv_connector 'NixlConnector': nixl is installed, but Sonar's NIXL transport is not built yet; "
            "use 'SonarConnector' (the same prefill/decode semantics over TCP)"
        )
