"""What every registered KV connector promises (a vendor's connector is tested by registering it)."""
from __future__ import annotations

import json

import pytest

from halserve.config import EngineConfig
from halserve.kv_connectors import resolve_connector_cls
from halserve.kv_connectors.base import KVConnector, KVTransferConfig
from halserve.plugins import get_plugin_manager

REGISTERED = [reg.name for reg in get_plugin_manager().kv_connectors]


def test_the_bundled_connectors_are_registered():
    assert {"SharedStorageConnector", "OffloadingConnector", "P2pConnector"} <= set(REGISTERED)


@pytest.mark.parametrize("name", REGISTERED)
def test_connector_contract(name, tmp_path):
    cls = resolve_connector_cls(KVTransferConfig(kv_connector=name))
    assert issubclass(cls, KVConnector) and cls.name == name and cls.description
    json.dumps(cls.describe())
    config = EngineConfig(model=str(tmp_path))
    transfer = KVTransferConfig(kv_connector=name, kv_connector_extra_config={"no_such_key": 1})
    with pytest.raises(ValueError) as info:
        cls.check_config(transfer, config)
    assert "no_such_key" in str(info.value) and all(key in str(info.value) for key in cls.extra_config_keys)
