"""The OpenAI-compatible HTTP gateway: an online producer over HTTP.

It speaks to the cluster only through :mod:`natsched.client.producer` (never nats directly): each HTTP
request becomes one :class:`natsched.wire.schema.Request` from the tenant its API key names, and the
admission outcome becomes an HTTP status. Modules: ``keys`` (API keys -> tenants), ``chat``
(the chat template), ``protocol`` (OpenAI bodies in and out), ``service`` (the request path),
``app`` (routes and middleware), ``sse`` (streaming with disconnect detection), ``server``
(uvicorn in the running loop), ``status`` (the cluster view, also ``natsched status``'s),
``status_page`` (``/status``), ``metrics``.
"""
