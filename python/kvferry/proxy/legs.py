"""The bodies of the two legs of a P/D request, and the prompt's size. Pure functions.

Whole-request transfer (as vLLM's toy proxy, tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py): the prefill leg is the client's request with ``max_tokens`` 1 (and
``max_completion_tokens`` 1 when present), ``stream`` false, no ``stream_options``, no
``min_tokens``/``min_completion_tokens``, and ``kv_transfer_params`` asking for a remote decode;
the decode leg is the client's request with the ``kv_transfer_params`` the prefill answered.

Layer-wise transfer: both legs at once, sharing a fresh ``transfer_id``; the prefill leg as above
with ``{"do_remote_decode": true, "transfer_id": T}``, the decode leg with ``{"do_remote_prefill":
true, "transfer_id": T, "remote_engine_id": E, "remote_host": H, "remote_port": P,
"remote_tp_size": N}`` and no ``remote_block_ids``, (E, H, P, N) being the chosen prefill
instance's connector endpoint (config.Connector).
"""

from __future__ import annotations

import math
import uuid
from typing import Any, Optional

from .config import Connector

# The toy proxy's prefill params: the connector fills in the rest in the prefill's answer.
WHOLE_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                        "remote_engine_id": None, "remote_block_ids": None,
                        "remote_host": None, "remote_port": None}


class BadRequest(ValueError):
    """The client's request cannot be served as a P/D request; the message says why."""


def new_transfer_id() -> str:
    return "kvferry-" + uuid.uuid4().hex


def _one_token(body: dict) -> dict:
    """The request cut to one token, answered whole: max_tokens (and max_completion_tokens when
    present) 1, not streamed, no minimum length."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out.pop("min_completion_tokens", None)
    return out


def prefill_body(body: dict, transfer_id: Optional[str] = None) -> dict:
    out = _one_token(body)
    if transfer_id is None:
        out["kv_transfer_params"] = dict(WHOLE_PREFILL_PARAMS)
    else:
        out["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return out


def decode_body(body: dict, kv_transfer_params: Optional[dict]) -> dict:
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def layerwise_decode_params(connector: Connector, transfer_id: str) -> dict:
    return {"do_remote_prefill": True, "transfer_id": transfer_id,
            "remote_engine_id": connector.engine_id, "remote_host": connector.host,
            "remote_port": connector.port, "remote_tp_size": connector.tp_size}


def release_body(body: dict, kv_transfer_params: dict) -> dict:
    """A decode leg for a client that left after its prefill answered: one token, not
    streamed, so the decode instance reads (and so frees) the prefill's hold at the least cost."""
    return _one_token(decode_body(body, kv_transfer_params))


def _is_token_list(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _text_tokens(text: str, bytes_per_token: float) -> int:
    return math.ceil(len(text.encode()) / bytes_per_token)


def prompt_tokens(endpoint: str, body: dict, bytes_per_token: float) -> tuple[int, bool]:
    """(tokens, exact): the prompt's token count when it is a token list, else an estimate
    from its UTF-8 size (config.ProxyConfig.bytes_per_token). Raises BadRequest for a request
    with no prompt or several (the KV of a P/D request belongs to one prompt)."""
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and (
                isinstance(prompt[0], str) or _is_token_list(prompt[0])):
            prompt = prompt[0]
        if _is_token_list(prompt):
            return len(prompt), True
        if isinstance(prompt, str) and prompt:
            return _text_tokens(prompt, bytes_per_token), False
        raise BadRequest("prompt: expected one prompt (a string or a list of token ids), found "
                         f"{type(prompt).__name__ if prompt is not None else 'none'}"
                         + (f" of {len(prompt)} prompts; send them as separate requests"
                            if isinstance(prompt, list) and prompt else ""))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of chat messages")
    size = 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            size += len(content.encode())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    size += len(part["text"].encode())
        elif content is not None:
            raise BadRequest(f"messages[{i}].content: expected a string or a list of parts, "
                             f"found {type(content).__name__}")
    return math.ceil(size / bytes_per_token), False
