"""The installed package, under the wheel test (tests/python/wheel_test.sh sets
KVFERRY_EXPECT_INSTALLED=1 and runs the Python tests with the venv's interpreter): everything is
imported from the install, the stubs and the CLI binary are there, and the console commands are
the ones setup.cfg declares. From the build tree (python_tests) these tests are skipped, saying
so."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

import kvferry
import kvferry._cli

INSTALLED = os.environ.get("KVFERRY_EXPECT_INSTALLED") == "1"
pytestmark = pytest.mark.skipif(
    not INSTALLED, reason="SKIPPED: runs under the wheel test only (python_wheel, "
    "KVFERRY_EXPECT_INSTALLED=1); here kvferry comes from build/python")


def test_everything_comes_from_the_install():
    prefix = os.path.realpath(sys.prefix)
    for module in (kvferry, kvferry._kvferry, kvferry._cli):
        assert os.path.realpath(module.__file__).startswith(prefix + os.sep), module.__file__
    here = os.path.dirname(kvferry.__file__)
    assert os.path.isfile(os.path.join(here, "_kvferry.pyi"))
    assert os.path.isfile(os.path.join(here, "py.typed"))
    assert os.access(kvferry._cli.binary_path(), os.X_OK)


def test_the_console_commands():
    dist = importlib.metadata.distribution("kvferry")
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert scripts == {"kvferry": "kvferry._cli:main", "kvferry-proxy": "kvferry.proxy.cli:main"}
    bindir = os.path.dirname(sys.executable)
    out = subprocess.run([os.path.join(bindir, "kvferry"), "plan", "--kind", "mha", "--layers",
                          "2", "--kv-heads", "4", "--head-dim", "8", "--prefill-tp", "1",
                          "--decode-tp", "1", "--remote-blocks", "1,2,3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    bad = subprocess.run([os.path.join(bindir, "kvferry"), "no-such-command"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0  # the binary's own exit status comes through
