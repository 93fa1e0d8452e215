"""A local JetStream cluster of nats-servers on loopback, for tests, chaos runs and trying an R3 stream.

``start()`` returns once every node logged ready and answers ``/healthz``, never on a TCP probe.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Final

from weightbus.embedded.server import EmbeddedNats, free_port
from weightbus.errors import NatsServerStartError

__all__ = ["CLUSTER_CONF", "EmbeddedCluster"]

#: The cluster config (one file for every node; per-node values from the environment). It is
#: ``ops/nats/cluster.conf`` without its comments; tests check the two stay the same.
CLUSTER_CONF: Final = """\
server_name: $WEIGHTBUS_NODE
listen: $WEIGHTBUS_CLIENT_LISTEN
http: $WEIGHTBUS_HTTP_LISTEN
jetstream {
  store_dir: $WEIGHTBUS_STORE
}
cluster {
  name: weightbus
  listen: $WEIGHTBUS_CLUSTER_LISTEN
  routes: [$WEIGHTBUS_ROUTE_A, $WEIGHTBUS_ROUTE_B, $WEIGHTBUS_ROUTE_C]
}
"""
_NAMES: Final = ("a", "b", "c")
_PORT_ATTEMPTS: Final = 3

log = logging.getLogger("weightbus.bus")


class EmbeddedCluster:
    """Three nats-servers forming one JetStream cluster on 127.0.0.1.

    Args:
        base_dir: where the stores (and the config, when built in) live; a temporary directory removed on
            ``stop()`` when None.
        config: a cluster config file using the ``WEIGHTBUS_*`` variables; ``CLUSTER_CONF`` when None.
        startup_timeout: seconds for every node to be ready and the cluster healthy.
        binary: path to nats-server (found like ``EmbeddedNats`` does when None).

    ``urls`` lists every node's client URL, comma-separated, which is what clients should be given.
    """

    def __init__(
        self,
        base_dir: str | Path | None = None,
        *,
        config: str | Path | None = None,
        startup_timeout: float = 20.0,
        binary: str | None = None,
    ) -> None:
        self._own_dir = base_dir is None
        self.base_dir = Path(base_dir) if base_dir is not None else Path(tempfile.mkdtemp(prefix="weightbus-cluster-"))
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if config is None:
            config = self.base_dir / "cluster.conf"
            Path(config).write_text(CLUSTER_CONF)
        self.config = Path(config)
        self.startup_timeout = startup_timeout
        self._binary = binary
        self._plan()

    def _plan(self) -> None:
        """Pick the three route ports and build the nodes (their client and monitoring ports: nats-server's)."""
        cluster = {n: free_port() for n in _NAMES}
        self.http_ports: dict[str, int] = {}
        routes = {f"WEIGHTBUS_ROUTE_{n.upper()}": f"nats-route://127.0.0.1:{cluster[n]}" for n in _NAMES}
        self.nodes: dict[str, EmbeddedNats] = {}
        for n in _NAMES:
            store = self.base_dir / f"node-{n}"
            env = {
                "WEIGHTBUS_NODE": f"weightbus-{n}",
                "WEIGHTBUS_CLIENT_LISTEN": "127.0.0.1:-1",
                "WEIGHTBUS_CLUSTER_LISTEN": f"127.0.0.1:{cluster[n]}",
                "WEIGHTBUS_HTTP_LISTEN": "127.0.0.1:-1",
                "WEIGHTBUS_STORE": str(store),
                **routes,
            }
            self.nodes[f"weightbus-{n}"] = EmbeddedNats(
                store_dir=store,
                binary=self._binary,
                config=self.config,
                env=env,
                startup_timeout=self.startup_timeout,
                log_file=self.base_dir / f"node-{n}.log",
            )

    @property
    def urls(self) -> str:
        """Every node's client URL, comma-separated."""
        return ",".join(node.url for node in self.nodes.values())

    def http_url(self, name: str) -> str:
        """The monitoring endpoint of node ``name`` (``weightbus-a``...), known once the node has started."""
        return f"http://127.0.0.1:{self.http_ports[name.rsplit('-', 1)[-1]]}"

    def _start_node(self, name: str) -> None:
        """Start node ``name``; pin the ports nats-server picked, so a restart comes back on them."""
        node = self.nodes[name]
        node.start()
        if node.http_port is None:
            raise NatsServerStartError(f"cluster node {name} did not log its monitoring port", _tail(node))
        self.http_ports[name.rsplit("-", 1)[-1]] = node.http_port
        node.env["WEIGHTBUS_CLIENT_LISTEN"] = f"127.0.0.1:{node.port}"
        node.env["WEIGHTBUS_HTTP_LISTEN"] = f"127.0.0.1:{node.http_port}"

    def start(self) -> EmbeddedCluster:
        """Start every node and wait until the cluster is healthy.

        Raises:
            NatsServerStartError: a node failed to start, or the cluster was not healthy in time.
        """
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            try:
                for name in self.nodes:
                    self._start_node(name)
                self.wait_healthy(list(self.nodes))
                return self
            except NatsServerStartError as exc:
                # The route ports are picked before any node binds: another process may take one meanwhile.
                if "address already in use" not in (exc.reason or "") or attempt == _PORT_ATTEMPTS:
                    self.stop()  # a half-started cluster must not outlive the failed start
                    raise
                self._stop_nodes()
                for n in _NAMES:
                    shutil.rmtree(self.base_dir / f"node-{n}", ignore_errors=True)
                log.warning("a cluster port was taken before its node bound it; new ports", extra={"attempt": attempt})
                self._plan()
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def healthy(self, name: str) -> bool:
        """True when node ``name`` answers 200 on ``/healthz`` (JetStream up, meta leader known)."""
        try:
            with urllib.request.urlopen(f"{self.http_url(name)}/healthz", timeout=1) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, names: list[str], timeout: float | None = None) -> None:
        """Wait until every node in ``names`` is healthy.

        Raises:
            NatsServerStartError: one was not healthy within ``timeout`` (``startup_timeout`` by default).
        """
        deadline = time.monotonic() + (timeout if timeout is not None else self.startup_timeout)
        pending = set(names)
        while pending:
            pending = {n for n in pending if not self.healthy(n)}
            if not pending:
                return
            if time.monotonic() > deadline:
                raise NatsServerStartError(f"cluster nodes {sorted(pending)} not healthy in time")
            time.sleep(0.1)  # polling nats-server's own health endpoint, not a TCP probe

    def kill(self, name: str) -> int:
        """SIGKILL node ``name`` by its pid (its store is kept); returns the pid."""
        node = self.nodes[name]
        pid = node.pid
        if pid is None:
            raise ValueError(f"node {name} is not running")
        node.kill()
        return pid

    def restart(self, name: str) -> None:
        """Start node ``name`` again on its ports and store, and wait until it is healthy."""
        self._start_node(name)
        self.wait_healthy([name])

    def stop(self) -> None:
        """Stop every node; remove a temporary base directory."""
        self._stop_nodes()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def _stop_nodes(self) -> None:
        for node in self.nodes.values():
            with contextlib.suppress(OSError):
                node.stop()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _tail(node: EmbeddedNats) -> str:
    return " | ".join(node.log_lines[-3:])
