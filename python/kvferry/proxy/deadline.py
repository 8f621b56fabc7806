"""One way to bound an await: ``async with deadline(seconds):`` raises asyncio.TimeoutError
when the block takes longer (asyncio.timeout on Python 3.11+, async_timeout before, which
aiohttp itself depends on there)."""

from __future__ import annotations

import sys
from typing import Any

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - Python 3.9 and 3.10
    from async_timeout import timeout as _timeout


def deadline(seconds: float) -> Any:
    return _timeout(seconds)
