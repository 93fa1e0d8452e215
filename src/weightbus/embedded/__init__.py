"""A nats-server run by weightbus itself: one embedded server (tests, the demo, ``weightbus server``)
and a 3-node cluster for chaos tests. Apart from the transport: ``weightbus.bus`` never imports this.
"""

from weightbus.embedded.cluster import EmbeddedCluster
from weightbus.embedded.server import MIN_NATS_SERVER_VERSION, EmbeddedNats, find_nats_server, free_port

__all__ = ["MIN_NATS_SERVER_VERSION", "EmbeddedCluster", "EmbeddedNats", "find_nats_server", "free_port"]
