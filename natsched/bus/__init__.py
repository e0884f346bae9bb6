"""The bus layer: the only package that imports ``nats``.

Everything on the wire is defined here — schemas (:mod:`natsched.bus.schema`), the codec
(:mod:`natsched.bus.codec`), subject names (:mod:`natsched.bus.subjects`), prefix hashing (:mod:`natsched.bus.blocks`) —
together with the connection (:class:`natsched.bus.connection.Bus`), the embedded server
(:mod:`natsched.bus.server`), provisioning (:mod:`natsched.bus.provision`) and the producer client
(:mod:`natsched.bus.client`).
"""
