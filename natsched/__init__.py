"""natsched: admission control and cache-aware routing for LLM inference on NATS JetStream.

The producer's API, importable from here::

    import asyncio
    import natsched

    async def main():
        client = await natsched.Client.connect("nats://127.0.0.1:4222")
        try:
            result = await client.submit(natsched.make_request("demo", "Hello"))
            print(result.text)
        finally:
            await client.close()

    asyncio.run(main())

Every error natsched raises derives from :class:`NatschedError`; a request that did not end
well raises one of :class:`RequestError`'s subclasses. The names load on first use, so
``import natsched`` alone imports neither NATS nor vLLM, Starlette or the simulator; the
services, the simulator and the command line live in the subpackages.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from natsched.errors import NatschedError

if TYPE_CHECKING:
    from natsched.client.errors import DuplicateRequest, Rejected, RequestError, RequestFailed, RequestTimeout
    from natsched.client.producer import Chunk, Client, Result, Timeouts, make_request

__all__ = [
    "__version__",
    "Client",
    "make_request",
    "Result",
    "Chunk",
    "Timeouts",
    "NatschedError",
    "RequestError",
    "Rejected",
    "RequestTimeout",
    "RequestFailed",
    "DuplicateRequest",
]

_LAZY = {
    "Client": "natsched.client.producer",
    "make_request": "natsched.client.producer",
    "Result": "natsched.client.producer",
    "Chunk": "natsched.client.producer",
    "Timeouts": "natsched.client.producer",
    "RequestError": "natsched.client.errors",
    "Rejected": "natsched.client.errors",
    "RequestTimeout": "natsched.client.errors",
    "RequestFailed": "natsched.client.errors",
    "DuplicateRequest": "natsched.client.errors",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("natsched")
    except PackageNotFoundError:  # a checkout on the path that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    """PEP 562: load a public name's module on first use, then keep the name here."""
    if name == "__version__":
        value: Any = _version()
    elif name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'natsched' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
