"""The connector module as vLLM loads it: ``getattr(import_module(kv_connector_module_path), kv_connector)``."""

from __future__ import annotations

import importlib

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1


def test_vllm_finds_the_connector_class_by_module_path_and_name() -> None:
    module = importlib.import_module("kvstore.connectors.vllm")
    assert list(module.__all__) == sorted(module.__all__) == ["KVStoreConnector"]
    connector_class = module.KVStoreConnector
    assert issubclass(connector_class, KVConnectorBase_V1)
