"""Browser-facing checks of the open mode (``--insecure-open``): Host, Origin, Content-Type. Pure.

Why only there: with API keys, a page in a browser cannot call the gateway (it has no key, and
an ``Authorization`` header makes the browser ask first, which the gateway never grants). Open,
any page the user visits could:

- **CSRF**: post a ``text/plain`` body (a "simple" request, sent without asking) to
  ``http://127.0.0.1:8000/v1/completions``: the gateway parsed it as JSON and spent the
  cluster's tokens. Refused: an inference call must say ``Content-Type: application/json``
  (415), and a request whose ``Origin`` is another site is refused (403);
- **DNS rebinding**: a name the attacker controls resolves first to its server, then to
  127.0.0.1, so the page reads the gateway's answers (``/status.json``: every tenant's usage)
  as same-origin. Refused: the ``Host`` must be a loopback name, the ``--host`` the gateway
  listens on, or one given with ``--allowed-host`` (403).
"""

from __future__ import annotations

from natsched.gateway.errors import Forbidden, UnsupportedMedia

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
#: listen addresses that name no host a client would send
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
JSON_TYPES = frozenset({"application/json"})


def host_name(host: str) -> str:
    """The name part of a ``Host`` header or an origin's authority: no port, no brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1:host.find("]")] if "]" in host else host
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() and ":" not in name else host


def check_host(host: str | None, bind_host: str, allowed: tuple[str, ...]) -> None:
    if "*" in allowed:
        return
    name = host_name(host or "")
    accepted = LOOPBACK_HOSTS | {host_name(a) for a in allowed}
    if bind_host not in WILDCARD_HOSTS:
        accepted |= {host_name(bind_host)}
    if name not in accepted:
        raise Forbidden(f"Host {(host or '')[:100]!r} is not one this open gateway answers to "
                        "(add it with --allowed-host)", code="host_not_allowed")


def check_origin(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> None:
    """A request from a page (it has ``Origin``) must come from the gateway's own origin or an
    allowed one; requests without ``Origin`` (curl, SDKs) are not a browser's cross-site calls."""
    if origin is None:
        return
    origin = origin.strip().lower()
    own = {f"{scheme}://{(host or '').strip().lower()}" for scheme in ("http", "https")}
    if origin in own or origin in {a.strip().lower().rstrip("/") for a in allowed}:
        return
    raise Forbidden(f"requests from the page at {origin[:100]!r} are not allowed on this open gateway "
                    "(add it with --allowed-origin)", code="origin_not_allowed")


def check_json(content_type: str | None) -> None:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media not in JSON_TYPES:
        raise UnsupportedMedia(f"send the body as Content-Type: application/json (got {media or 'none'!r})",
                               code="unsupported_media_type")
