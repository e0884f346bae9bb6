"""The bus layer: the only package that imports ``nats``.

Everything on the wire is defined here — schemas (:mod:`bus.schema`), the codec
(:mod:`bus.codec`), subject names (:mod:`bus.subjects`), prefix hashing (:mod:`bus.blocks`) —
together with the connection (:class:`bus.connection.Bus`), the embedded server
(:mod:`bus.server`), provisioning (:mod:`bus.provision`) and the producer client
(:mod:`bus.client`).
"""
