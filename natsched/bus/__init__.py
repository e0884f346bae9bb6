"""The bus layer: the only package that imports ``nats``.

Everything on the wire is defined here — schemas (:mod:`natsched.wire.schema`), the codec
(:mod:`natsched.wire.codec`), subject names (:mod:`natsched.wire.subjects`), prefix hashing (:mod:`natsched.wire.blocks`) —
together with the connection (:class:`natsched.bus.connection.Bus`), the embedded server
(:mod:`natsched.bus.server`), provisioning (:mod:`natsched.bus.provision`) and the producer client
(:mod:`natsched.client.producer`).
"""
