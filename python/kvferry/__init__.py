"""kvferry: moves the KV cache of LLM requests from prefill to decode instances.

The native module ``_kvferry`` holds the connector (Scheduler, Worker), the cache spec and the
rank table; ``kvferry.vllm`` adapts them to vLLM's KV connector interface.
"""

from ._kvferry import (  # noqa: F401
    CacheSpec,
    CancelledError,
    Error,
    HostMemory,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    NotSupportedError,
    PeerDisconnectedError,
    RankTable,
    ResourceExhaustedError,
    Scheduler,
    TimeoutError,
    UnauthenticatedError,
    UnavailableError,
    Worker,
    transport_backends,
)

__all__ = [
    "CacheSpec", "HostMemory", "RankTable", "Scheduler", "Worker", "Error", "InvalidArgumentError",
    "NotFoundError", "UnavailableError", "PeerDisconnectedError", "TimeoutError",
    "CancelledError", "ResourceExhaustedError", "NotSupportedError", "InternalError",
    "UnauthenticatedError", "transport_backends",
]
