"""kvferry-proxy's pure parts: the legs' bodies (the shapes of vLLM's toy proxy and of layer-wise
transfer), the prompt's size, the configuration from flags and a file, and the choice of
instance."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("aiohttp", reason="python3-aiohttp is not installed (make deps)")

from kvferry.proxy import cli, legs  # noqa: E402
from kvferry.proxy.config import (ConfigError, Connector, InstanceConfig,  # noqa: E402
                                  from_sources, instance_from_flag)
from kvferry.proxy.pool import Pool  # noqa: E402


def test_the_prefill_leg_is_the_toy_proxys():
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "max_completion_tokens": 50,
            "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 3,
            "min_completion_tokens": 3, "temperature": 0.5,
            "kv_transfer_params": {"from": "the client"}}
    leg = legs.prefill_body(body)
    assert leg == {"model": "m", "prompt": "hi", "max_tokens": 1, "max_completion_tokens": 1,
                   "stream": False, "temperature": 0.5,
                   "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                          "remote_engine_id": None, "remote_block_ids": None,
                                          "remote_host": None, "remote_port": None}}
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's body is untouched
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    decode = legs.decode_body(body, params)
    assert decode["kv_transfer_params"] is params and decode["max_tokens"] == 50
    assert "kv_transfer_params" not in legs.decode_body(body, None)


def test_layerwise_legs_share_a_transfer_id():
    t = legs.new_transfer_id()
    assert t != legs.new_transfer_id() and t.startswith("kvferry-")
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 9}
    assert legs.prefill_body(body, t)["kv_transfer_params"] == {"do_remote_decode": True,
                                                                "transfer_id": t}
    c = Connector("prefill-0", "10.0.0.1", 5557, 2)
    assert legs.layerwise_decode_params(c, t) == {
        "do_remote_prefill": True, "transfer_id": t, "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.1", "remote_port": 5557, "remote_tp_size": 2}


def test_the_release_leg_is_one_token_not_streamed():
    body = {"model": "m", "messages": [], "max_tokens": 9, "stream": True,
            "stream_options": {}, "max_completion_tokens": 9}
    leg = legs.release_body(body, {"do_remote_prefill": True})
    assert (leg["max_tokens"], leg["max_completion_tokens"], leg["stream"]) == (1, 1, False)
    assert "stream_options" not in leg and leg["kv_transfer_params"] == {"do_remote_prefill": True}


@pytest.mark.parametrize("endpoint, body, expected", [
    ("completions", {"prompt": list(range(300))}, (300, True)),
    ("completions", {"prompt": [list(range(7))]}, (7, True)),
    ("completions", {"prompt": "a" * 401}, (101, False)),
    ("completions", {"prompt": ["é" * 10]}, (5, False)),  # 20 UTF-8 bytes
    ("chat_completions", {"messages": [{"role": "system", "content": "x" * 40},
                                       {"role": "user", "content": [
                                           {"type": "text", "text": "y" * 40},
                                           {"type": "image_url", "image_url": {}}]}]},
     (20, False)),
])
def test_prompt_tokens_counted_or_estimated(endpoint, body, expected):
    assert legs.prompt_tokens(endpoint, body, 4.0) == expected


@pytest.mark.parametrize("endpoint, body, words", [
    ("completions", {}, "one prompt"),
    ("completions", {"prompt": ["a", "b"]}, "2 prompts"),
    ("completions", {"prompt": [[1], [2]]}, "separate requests"),
    ("chat_completions", {"messages": []}, "non-empty list"),
    ("chat_completions", {"messages": [{"content": 3}]}, r"messages\[0\]\.content"),
])
def test_requests_without_one_prompt_are_refused(endpoint, body, words):
    with pytest.raises(legs.BadRequest, match=words):
        legs.prompt_tokens(endpoint, body, 4.0)


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps({
        "port": 9000, "mode": "layerwise", "layerwise_min_tokens": 128,
        "prefill": [{"url": "http://10.0.0.1:8100", "name": "p0",
                     "connector": {"engine_id": "prefill-0", "host": "10.0.0.1", "port": 5557,
                                   "tp_size": 2}}],
        "decode": ["http://10.0.0.2:8200/"]}))
    config = cli.load(["--config", str(path), "--port", "9100", "--prefill-timeout-s", "7"])
    assert (config.port, config.mode, config.layerwise_min_tokens) == (9100, "layerwise", 128)
    assert config.prefill_timeout_s == 7.0
    assert config.prefill == [InstanceConfig("http://10.0.0.1:8100", "p0",
                                             Connector("prefill-0", "10.0.0.1", 5557, 2))]
    assert config.decode == [InstanceConfig("http://10.0.0.2:8200", "10.0.0.2:8200")]
    replaced = cli.load(["--config", str(path), "--decode", "http://10.0.0.3:8200,name=d9"])
    assert [d.name for d in replaced.decode] == ["d9"]


def test_a_toml_file(tmp_path):
    path = tmp_path / "proxy.toml"
    path.write_text('mode = "whole"\nport = 8001\n\n[[prefill]]\nurl = "http://127.0.0.1:8100"'
                    '\n\n[[decode]]\nurl = "http://127.0.0.1:8200"\nname = "d"\n')
    config = cli.load(["--config", str(path)])
    assert (config.port, config.decode[0].name) == (8001, "d")


def test_a_prefill_flag_with_its_connector():
    i = instance_from_flag("http://h:1,name=p,engine_id=e,kv_host=k,kv_port=5557,tp_size=4",
                           "prefill")
    assert i == InstanceConfig("http://h:1", "p", Connector("e", "k", 5557, 4))


@pytest.mark.parametrize("file, flags, words", [
    ({}, ["--decode", "http://d:1"], "at least one prefill"),
    ({"prefill": ["http://p:1"]}, [], "at least one decode"),
    ({"prefill": ["http://p:1"], "decode": ["http://d:1"], "bogus": 1}, [],
     "unknown settings \\['bogus'\\]"),
    ({"prefill": ["http://p:1/v1"], "decode": ["http://d:1"]}, [], "without /v1"),
    ({"prefill": ["p:1"], "decode": ["http://d:1"]}, [], "expected a URL"),
    ({"prefill": ["http://p:1"], "decode": ["http://d:1"], "mode": "layerwise"}, [],
     "connector endpoint"),
    ({"prefill": ["http://p:1"], "decode": ["http://d:1"], "prefill_timeout_s": 0}, [],
     "prefill_timeout_s: expected a positive number, found 0"),
    ({"prefill": ["http://p:1"], "decode": ["http://d:1"], "port": "80"}, [],
     "port: expected a int"),
    ({"decode": ["http://d:1"]}, ["--prefill", "http://p:1,engine_id=e,kv_host=h"],
     "engine_id, kv_host and kv_port together"),
    ({"decode": ["http://d:1"]}, ["--prefill", "http://p:1,kv_port=99999,engine_id=e,kv_host=h"],
     "1..65535"),
    ({"prefill": ["http://p:1", "http://p:1"], "decode": ["http://d:1"]}, [],
     "names must differ"),
])
def test_bad_settings_are_named(tmp_path, file, flags, words):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(file))
    with pytest.raises(ConfigError, match=words):
        cli.load(["--config", str(path)] + flags)


def test_a_missing_or_broken_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        cli.load(["--config", str(tmp_path / "none.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid json"):
        cli.load(["--config", str(bad)])


def test_least_outstanding_among_instances_up_ties_rotate():
    pool = Pool("decode", [InstanceConfig(f"http://d:{i}", f"d{i}") for i in range(3)])
    a, b, c = pool.instances
    assert [pool.pick().name for _ in range(6)] == ["d0", "d1", "d2", "d0", "d1", "d2"]
    a.outstanding, b.outstanding, c.outstanding = 2, 1, 1
    assert {pool.pick().name for _ in range(4)} == {"d1", "d2"}
    pool.mark_down(b, "test")
    assert pool.pick() is c and pool.pick(exclude=[c]) is a
    pool.mark_down(a, "test")
    pool.mark_down(c, "test")
    assert pool.pick() is None and pool.up_count() == 0
    pool.mark_up(b)
    assert pool.pick() is b
    prefill = Pool("prefill", [InstanceConfig("http://p:1", "p0"),
                               InstanceConfig("http://p:2", "p1", Connector("e", "h", 1, 1))])
    assert all(prefill.pick(need_connector=True).name == "p1" for _ in range(3))


def test_from_sources_without_a_file():
    config = from_sources({}, {"prefill": ["http://p:1"], "decode": ["http://d:1"],
                               "port": None})
    assert config.port == 8000 and config.mode == "whole"


def test_unknown_paths_methods_and_bodies_past_the_cap_are_json_errors():
    """aiohttp's own answers (404 for a path the proxy has not, 405, 413 past
    --max-request-mib) come in the OpenAI API's error shape, as the proxy's others do; before,
    a plain-text '404: Not Found'."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from kvferry.proxy.app import build_app

    config = cli.load(["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9",
                       "--max-request-mib", "1"])
    assert config.max_request_mib == 1

    async def go():
        async with TestClient(TestServer(build_app(config))) as client:
            for method, path, body, status in (
                    ("GET", "/v1/nothing-here", None, 404),
                    ("POST", "/health", None, 405),
                    ("POST", "/v1/completions", b"[" + b"1," * (600 << 10) + b"1]", 413)):
                r = await client.request(method, path, data=body)
                assert r.status == status, (path, r.status)
                assert r.headers["Content-Type"].startswith("application/json"), path
                answer = await r.json()
                assert answer["error"]["code"] == status, answer
                assert answer["error"]["type"] == "invalid_request_error", answer
                assert answer["error"]["message"], answer
                if status == 413:
                    assert "--max-request-mib" in answer["error"]["message"], answer

    asyncio.run(go())
    with pytest.raises(ConfigError, match="max_request_mib"):
        cli.load(["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9",
                  "--max-request-mib", "0"])
