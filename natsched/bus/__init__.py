"""The NATS transport: the only package that imports ``nats``.

The connection (:class:`natsched.bus.connection.Bus`: publishing with dedup ids, core pub/sub,
durable pull consumers), provisioning (:mod:`natsched.bus.provision`), the embedded server
(:mod:`natsched.bus.server`), and the handles services hold instead of nats objects:
``bus.kv(bucket)`` (:mod:`natsched.bus.kv`), ``bus.stream(name)`` (:mod:`natsched.bus.streams`),
``bus.inbox(subject)``. What travels on the wire is defined apart, in :mod:`natsched.wire`.
"""
