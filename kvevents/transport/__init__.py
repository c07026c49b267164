"""Transports: how batches travel between a publisher and its consumers.

``zmq/`` is the ZeroMQ transport (vLLM's wire: frames, publisher, replay server, subscriber).
A new transport gets a sibling package here; its consumer side implements
:class:`kvevents.source.EventSource` and registers in :data:`kvevents.source.SOURCES`, its
producer side implements :class:`kvevents.EventPublisher` and registers in
:class:`kvevents.EventPublisherFactory`.
"""
