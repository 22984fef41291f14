"""kvstore's vLLM KV connector: ``KVStoreConnector`` (``kv_connector_module_path: "kvstore.connectors.vllm"``)."""

from kvstore.connectors.vllm.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]
