"""A vLLM KV connector over kvbus: engines share context as kvbus agents.

``kv_connector_module_path: "kvbus.integrations.vllm"`` with ``kv_connector: "KVBusConnector"``.
`KVBusConnector` needs vLLM (the ``[vllm]`` extra) and is imported on first use, so that the
parts that do not (config, keys, layout, protocol, the control client) import without it.
"""

from __future__ import annotations

from typing import Any

from kvbus.integrations.vllm.config import ConnectorConfig
from kvbus.integrations.vllm.control import KVBusControl, connector_config

__all__ = ["ConnectorConfig", "KVBusConnector", "KVBusControl", "connector_config"]


def __getattr__(name: str) -> Any:
    # PEP 562: vLLM resolves the class with getattr(module, "KVBusConnector").
    if name == "KVBusConnector":
        from kvbus.integrations.vllm.connector import KVBusConnector

        return KVBusConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
