"""kvferry's vLLM general plugin: registers the connector name ``KvferryConnector``.

The wheel declares the entry point ``kvferry = kvferry.vllm_plugin:register`` in the group
``vllm.general_plugins``. vLLM's ``load_general_plugins`` (vllm/plugins/__init__.py) runs every
such entry point in every process it starts (API server, engine core, workers) before any work;
``VLLM_PLUGINS``, when set, lists the entry point names to load (include ``kvferry``). This one
registers ``KvferryConnector`` with ``KVConnectorFactory.register_connector`` as a lazy
(module path, class name) pair, so that::

    --kv-transfer-config '{"kv_connector": "KvferryConnector", "kv_role": "kv_producer", ...}'

works without ``kv_connector_module_path``, which keeps working (the factory looks up registered
names first, then the module path).

vLLM calls the plugin without a guard and may call it more than once in one process; its
``register_connector`` raises ``ValueError`` for a name already registered. So ``register`` never
raises: a second call, a name registered meanwhile, a vLLM without the factory or a name taken
by another connector are logged and reported in its return value.
"""

from __future__ import annotations

import logging
from typing import Any

CONNECTOR_NAME = "KvferryConnector"
CONNECTOR_MODULE = "kvferry.vllm"
CONNECTOR_CLASS = "KvferryConnector"

logger = logging.getLogger("kvferry.vllm")


def _names_this_connector(loader: Any) -> bool:
    """Whether a registry entry (vLLM's lazy loader, a closure over the module path and class
    name) points at kvferry's connector, judged without importing anything."""
    cells = getattr(loader, "__closure__", None) or ()
    values = set()
    for cell in cells:
        try:
            values.add(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return CONNECTOR_MODULE in values and CONNECTOR_CLASS in values


def register() -> bool:
    """Registers KvferryConnector with vLLM's KVConnectorFactory. True when the name resolves to
    kvferry's connector (now or already); False when it cannot: vLLM has no KVConnectorFactory
    (use kv_connector_module_path "kvferry.vllm"), or another connector took the name."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import (  # type: ignore
            KVConnectorFactory)
    except ImportError as e:
        logger.warning("kvferry: this vLLM has no KVConnectorFactory (%s); name the connector "
                       "with \"kv_connector_module_path\": \"kvferry.vllm\" instead", e)
        return False
    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        return _already_registered(registry[CONNECTOR_NAME])
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    except ValueError:  # registered between the look-up and here: vLLM refuses duplicates
        entry = registry.get(CONNECTOR_NAME) if isinstance(registry, dict) else None
        return _already_registered(entry)
    logger.debug("kvferry: registered %s (%s.%s) with vLLM's KVConnectorFactory",
                 CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    return True


def _already_registered(entry: Any) -> bool:
    """A second registration: fine when the entry is kvferry's (or cannot be read, in a vLLM
    whose registry is not a dict); a warning when another package took the name, since vLLM
    then resolves the name to that package's class, module path or not."""
    if entry is None or _names_this_connector(entry):
        return True
    logger.warning("kvferry: vLLM's KVConnectorFactory already has a connector named %s that is "
                   "not %s.%s (another installed package registered it); vLLM will load that "
                   "one for \"kv_connector\": \"%s\", with or without kv_connector_module_path. "
                   "Uninstall the package that registers it", CONNECTOR_NAME, CONNECTOR_MODULE,
                   CONNECTOR_CLASS, CONNECTOR_NAME)
    return False
