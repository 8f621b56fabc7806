"""The connector name through vLLM's plugin entry points (issue 21, item 2).

vLLM is not installed here, so a stub stands in for the two pieces of vLLM involved, written to
the behaviour read in vLLM's sources (main branch): vllm/plugins/__init__.py
(``load_general_plugins``: once per process, every entry point of the group
``vllm.general_plugins`` whose name VLLM_PLUGINS lists, or all when it is unset; a plugin that
fails to load is logged and skipped; each loaded function is called without a guard) and
vllm/distributed/kv_transfer/kv_connector/factory.py (``KVConnectorFactory``: a class-level
registry of lazy loaders; ``register_connector`` raises ValueError for a name already there;
``get_connector_class`` resolves a registered name first, else imports
``kv_connector_module_path`` and takes the class named ``kv_connector``, else raises ValueError).

The entry points come from the installed distribution when kvferry is installed (the wheel test
sets KVFERRY_EXPECT_INSTALLED=1, so there they must), else from setup.cfg, which the wheel is
built from.
"""
from __future__ import annotations

import configparser
import importlib
import importlib.metadata
import logging
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvferry.vllm
import kvferry.vllm_plugin

SETUP_CFG = Path(__file__).resolve().parents[2] / "setup.cfg"
GROUP = "vllm.general_plugins"


def declared_entry_points() -> list[importlib.metadata.EntryPoint]:
    """The entry points of setup.cfg, as the wheel declares them."""
    cfg = configparser.ConfigParser()
    assert cfg.read(SETUP_CFG), f"{SETUP_CFG} is missing"
    out = []
    for group, lines in cfg["options.entry_points"].items():
        for line in lines.strip().splitlines():
            name, value = (x.strip() for x in line.split("=", 1))
            out.append(importlib.metadata.EntryPoint(name=name, value=value, group=group))
    return out


def installed_distribution():
    try:
        dist = importlib.metadata.distribution("kvferry")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is None and os.environ.get("KVFERRY_EXPECT_INSTALLED") == "1":
        pytest.fail("KVFERRY_EXPECT_INSTALLED=1 but no kvferry distribution is installed")
    return dist


def plugin_entry_points() -> list[importlib.metadata.EntryPoint]:
    dist = installed_distribution()
    points = dist.entry_points if dist is not None else declared_entry_points()
    return [p for p in points if p.group == GROUP]


def stub_vllm(monkeypatch, with_factory=True):
    """vLLM's plugin loader and connector factory, as read in its sources (module docstring)."""
    log = logging.getLogger("stub.vllm")
    modules = {}
    for name in ("vllm", "vllm.distributed", "vllm.distributed.kv_transfer",
                 "vllm.distributed.kv_transfer.kv_connector"):
        modules[name] = types.ModuleType(name)

    class KVConnectorFactory:
        _registry: dict = {}

        @classmethod
        def register_connector(cls, name, module_path, class_name):
            if name in cls._registry:
                raise ValueError(f"Connector '{name}' is already registered.")

            def loader():
                module = importlib.import_module(module_path)
                return getattr(module, class_name)

            cls._registry[name] = loader

        @classmethod
        def get_connector_class(cls, kv_transfer_config):
            name = kv_transfer_config.kv_connector
            if name in cls._registry:
                return cls._registry[name]()
            path = kv_transfer_config.kv_connector_module_path
            if path is None:
                raise ValueError(f"Unsupported connector type: {name}")
            return getattr(importlib.import_module(path), name)

    if with_factory:
        factory = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.factory")
        factory.KVConnectorFactory = KVConnectorFactory
        modules[factory.__name__] = factory
    plugins = types.ModuleType("vllm.plugins")
    plugins.plugins_loaded = False

    def load_general_plugins(entry_points=plugin_entry_points):
        if plugins.plugins_loaded:
            return
        plugins.plugins_loaded = True
        allowed = (os.environ["VLLM_PLUGINS"].split(",") if "VLLM_PLUGINS" in os.environ
                   else None)
        funcs = []
        for plugin in entry_points():
            if allowed is None or plugin.name in allowed:
                try:
                    funcs.append(plugin.load())
                except Exception:  # vLLM's loader: log and go on
                    log.exception("Failed to load plugin %s", plugin.name)
        for func in funcs:
            func()

    plugins.load_general_plugins = load_general_plugins
    modules["vllm.plugins"] = plugins
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return SimpleNamespace(factory=KVConnectorFactory, plugins=plugins)


def transfer_config(name="KvferryConnector", module_path=None):
    return SimpleNamespace(kv_connector=name, kv_connector_module_path=module_path)


def test_the_wheel_declares_the_general_plugin():
    points = plugin_entry_points()
    assert [(p.name, p.value) for p in points] == [("kvferry", "kvferry.vllm_plugin:register")]
    dist = installed_distribution()
    if dist is not None:  # the installed metadata is what setup.cfg declares
        declared = {(p.group, p.name, p.value) for p in declared_entry_points()}
        assert declared <= {(p.group, p.name, p.value) for p in dist.entry_points}


def test_vllm_resolves_the_name_without_a_module_path(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    vllm = stub_vllm(monkeypatch)
    with pytest.raises(ValueError, match="Unsupported connector type"):
        vllm.factory.get_connector_class(transfer_config())  # before the plugins ran
    vllm.plugins.load_general_plugins()
    assert vllm.factory.get_connector_class(transfer_config()) is kvferry.vllm.KvferryConnector
    # kv_connector_module_path keeps working, registered name or not.
    assert vllm.factory.get_connector_class(
        transfer_config(module_path="kvferry.vllm")) is kvferry.vllm.KvferryConnector
    assert vllm.factory.get_connector_class(
        transfer_config("KvferryConnectorStats", "kvferry.vllm")) is \
        kvferry.vllm.KvferryConnectorStats


def test_registering_twice_never_raises(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    vllm = stub_vllm(monkeypatch)
    vllm.plugins.load_general_plugins()
    vllm.plugins.plugins_loaded = False  # vLLM loads plugins in every process it starts
    vllm.plugins.load_general_plugins()
    assert kvferry.vllm_plugin.register() is True
    assert list(vllm.factory._registry) == ["KvferryConnector"]
    assert vllm.factory.get_connector_class(transfer_config()) is kvferry.vllm.KvferryConnector


def test_vllm_plugins_must_name_kvferry_when_set(monkeypatch):
    vllm = stub_vllm(monkeypatch)
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    vllm.plugins.load_general_plugins()
    with pytest.raises(ValueError, match="Unsupported connector type"):
        vllm.factory.get_connector_class(transfer_config())
    vllm.plugins.plugins_loaded = False
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin,kvferry")
    vllm.plugins.load_general_plugins()
    assert vllm.factory.get_connector_class(transfer_config()) is kvferry.vllm.KvferryConnector


def test_a_name_taken_by_another_package_is_reported_not_raised(monkeypatch, caplog):
    vllm = stub_vllm(monkeypatch)
    vllm.factory.register_connector("KvferryConnector", "elsewhere.connectors", "Other")
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        assert kvferry.vllm_plugin.register() is False
    assert "not kvferry.vllm.KvferryConnector" in caplog.text


def test_a_vllm_without_the_factory_is_reported_not_raised(monkeypatch, caplog):
    stub_vllm(monkeypatch, with_factory=False)
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        assert kvferry.vllm_plugin.register() is False
    assert "kv_connector_module_path" in caplog.text
