"""How a client reaches and authenticates to NATS: credentials, TLS, and the replicas of a stream it creates.

A secret never reaches a log, an error or a ``repr`` (``redact_url``, ``ConnectOptions.redact``); any TLS option
means TLS or a typed error; a missing file is reported by path before connecting.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from weightbus.errors import BusConfigError

__all__ = [
    "ENV",
    "NATS_CONTEXT_ENV",
    "NATS_ENV",
    "NATS_URL_ENV",
    "ConnectOptions",
    "NatsContext",
    "context_path",
    "load_context",
    "nats_url_from_env",
    "redact_url",
]

#: The environment variable of each option (the CLI flags read the same ones).
ENV: Final = {
    "creds": "WEIGHTBUS_CREDS",
    "nkey_seed": "WEIGHTBUS_NKEY_SEED",
    "token": "WEIGHTBUS_TOKEN",
    "user": "WEIGHTBUS_USER",
    "password": "WEIGHTBUS_PASSWORD",
    "tls_ca": "WEIGHTBUS_TLS_CA",
    "tls_cert": "WEIGHTBUS_TLS_CERT",
    "tls_key": "WEIGHTBUS_TLS_KEY",
    "replicas": "WEIGHTBUS_REPLICAS",
}
#: The ``nats`` CLI's variable of each option, read after the ``WEIGHTBUS_*`` ones (``ENV``).
NATS_ENV: Final = {
    "creds": "NATS_CREDS",
    "nkey_seed": "NATS_NKEY",
    "token": "NATS_TOKEN",
    "user": "NATS_USER",
    "password": "NATS_PASSWORD",
    "tls_ca": "NATS_CA",
    "tls_cert": "NATS_CERT",
    "tls_key": "NATS_KEY",
}
#: Names the ``nats`` CLI context to read (as ``--context NAME`` does).
NATS_CONTEXT_ENV: Final = "NATS_CONTEXT"
#: Where a NATS URL is read from, first found wins: weightbus's own variable, then the ``nats`` CLI's.
NATS_URL_ENV: Final = ("WEIGHTBUS_NATS", "NATS_URL")
_CREDENTIAL: Final = ("creds", "nkey_seed", "token", "user", "password")
_CLIENT_CERT: Final = ("tls_cert", "tls_key")
#: A context's keys and the option each one sets.
_CONTEXT_KEYS: Final = {
    "creds": "creds",
    "nkey": "nkey_seed",
    "token": "token",
    "user": "user",
    "password": "password",
    "ca": "tls_ca",
    "cert": "tls_cert",
    "key": "tls_key",
}
_PATH_FIELDS: Final = ("creds", "nkey_seed", "tls_ca", "tls_cert", "tls_key")
# Context keys that change where or how a client connects, which weightbus cannot honour: refused, not ignored.
_UNSUPPORTED_CONTEXT_KEYS: Final = (
    "nsc",
    "user_jwt",
    "jetstream_domain",
    "jetstream_api_prefix",
    "tls_first",
    "windows_cert_store",
)
_MASK: Final = "***"
_USERINFO = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)(?P<userinfo>[^@/\s,]+)@", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` (or a comma-separated list) with any password or token in its userinfo replaced by ``***``.

    ``nats://alice:s3cret@h:4222`` becomes ``nats://alice:***@h:4222``; ``nats://tok@h`` becomes
    ``nats://***@h``. Text that is not a URL is returned unchanged.
    """

    def _mask(match: re.Match[str]) -> str:
        userinfo = match.group("userinfo")
        user, sep, _ = userinfo.partition(":")
        shown = f"{user}:{_MASK}" if sep else _MASK
        return f"{match.group('scheme')}{shown}@"

    return _USERINFO.sub(_mask, url)


def nats_url_from_env(
    default: str, environ: Mapping[str, str] | None = None, *, context: str | NatsContext | None = None
) -> str:
    """The NATS URL of the first non-empty variable of ``NATS_URL_ENV``, else the context's ``url``, else ``default``.

    The context is ``context`` (a name, or one already loaded), else the one ``NATS_CONTEXT`` names, else none.

    Raises:
        BusConfigError: the named context cannot be read.
    """
    env = os.environ if environ is None else environ
    for var in NATS_URL_ENV:
        value = env.get(var)
        if value:
            return value
    ctx = _context(context, env)
    if ctx is not None and ctx.url:
        return ctx.url
    return default


@dataclasses.dataclass(frozen=True, kw_only=True)
class NatsContext:
    """A ``nats`` CLI context: a named JSON file of connection settings (``nats context add``).

    Attributes:
        name: the context's name.
        path: the file it was read from.
        url: its server URL(s), or None.
        values: the ``ConnectOptions`` fields it sets (``creds``, ``nkey_seed``, ``token``, ``user``,
            ``password``, ``tls_ca``, ``tls_cert``, ``tls_key``), file paths with ``~`` expanded.
    """

    name: str
    path: Path
    url: str | None = None
    values: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)


def context_path(name: str, environ: Mapping[str, str] | None = None) -> Path:
    """The file of context ``name``: ``$XDG_CONFIG_HOME/nats/context/<name>.json`` (``~/.config`` by default).

    A name holding a path separator, or ending in ``.json``, is taken as the file's path.
    """
    env = os.environ if environ is None else environ
    if os.sep in name or name.endswith(".json"):
        return Path(name).expanduser()
    config = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(config) / "nats" / "context" / f"{name}.json"


def load_context(name: str, environ: Mapping[str, str] | None = None) -> NatsContext:
    """Read the ``nats`` CLI context ``name`` (see ``context_path``).

    Its keys ``url``, ``creds``, ``nkey``, ``token``, ``user``, ``password``, ``ca``, ``cert`` and ``key``
    are used; ``description`` and other keys that do not change the connection are ignored.

    Raises:
        BusConfigError: the file is missing or not a JSON object, a key is not a string, or the context
            uses a setting weightbus cannot honour (``nsc``, ``user_jwt``, a JetStream domain or API prefix,
            ``tls_first``, a Windows certificate store).
    """
    env = os.environ if environ is None else environ
    path = context_path(name, env)
    where = f"nats context {name!r} ({path})"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BusConfigError(f"{where}: file not found (create it with `nats context add`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BusConfigError(f"{where}: cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise BusConfigError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BusConfigError(f"{where}: not a JSON object")
    unsupported = [key for key in _UNSUPPORTED_CONTEXT_KEYS if data.get(key)]
    if unsupported:
        raise BusConfigError(
            f"{where}: weightbus does not support {', '.join(unsupported)} in a context; set url and creds"
            " (or user and password) instead"
        )
    found: dict[str, str] = {}
    for key in ("url", *_CONTEXT_KEYS):
        value = data.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise BusConfigError(f"{where}: {key} must be a string")
        field = _CONTEXT_KEYS.get(key, key)
        found[field] = str(Path(value).expanduser()) if field in _PATH_FIELDS else value
    url = found.pop("url", None)
    return NatsContext(name=name, path=path, url=url, values=_token_from_user(found))


def _context(context: str | NatsContext | None, env: Mapping[str, str]) -> NatsContext | None:
    if isinstance(context, NatsContext):
        return context
    name = context or env.get(NATS_CONTEXT_ENV)
    return load_context(name, env) if name else None


def _token_from_user(values: dict[str, str]) -> dict[str, str]:
    """The ``nats`` CLI's reading of a user without a password or token: the user is a token."""
    if values.get("user") and not values.get("password") and not values.get("token"):
        out = {k: v for k, v in values.items() if k != "user"}
        out["token"] = values["user"]
        return out
    return values


def _fill(values: dict[str, Any], fallback: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with the gaps filled from a lower-precedence source, taken by groups.

    The fallback's credential is used only when ``values`` has none, its client certificate only when
    ``values`` has none, and its CA only when ``values`` has none.
    """
    out = dict(values)
    for group in (_CREDENTIAL, _CLIENT_CERT, ("tls_ca",)):
        if not any(out.get(f) is not None for f in group):
            out.update({f: fallback[f] for f in group if fallback.get(f) is not None})
    return out


def _url_secrets(url: str) -> list[str]:
    found = []
    for part in url.split(","):
        try:
            parsed = urlsplit(part.strip())
        except ValueError:
            continue
        if parsed.password:
            found.append(parsed.password)
        elif parsed.username and "@" in part:
            found.append(parsed.username)  # a bare token in the userinfo
    return found


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConnectOptions:
    """Credentials, TLS and stream-creation settings for ``weightbus.bus.connect``.

    Attributes:
        creds: path of a NATS ``.creds`` file (JWT + NKEY seed, from ``nsc``).
        nkey_seed: path of a file holding an NKEY user seed (``SU...``).
        token: an authentication token.
        user: a user name (with ``password``).
        password: the user's password.
        tls_ca: PEM file of the CA that signed the server's certificate (enables TLS).
        tls_cert: PEM client certificate, for servers that verify clients (with ``tls_key``).
        tls_key: PEM private key of ``tls_cert``.
        replicas: replicas of the ``WEIGHTBUS`` stream when ``connect`` has to create it (1 on a single
            server, 3 on a 3-node cluster). An existing stream is never changed by connecting.

    ``creds`` and ``nkey_seed`` need the ``nkeys`` package (``pip install weightbus[auth]``).
    """

    creds: str | None = None
    nkey_seed: str | None = None
    token: str | None = dataclasses.field(default=None, repr=False)
    user: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.replicas > 5:
            raise BusConfigError(f"replicas must be between 1 and 5, not {self.replicas}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise BusConfigError("a TLS client certificate needs both --tls-cert and --tls-key")
        if self.password is not None and self.user is None:
            raise BusConfigError("a password needs a user (--user)")
        if self.creds is not None and self.nkey_seed is not None:
            raise BusConfigError("pass a creds file or an NKEY seed, not both")

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        context: str | NatsContext | None = None,
        **overrides: Any,
    ) -> ConnectOptions:
        """Options from keyword arguments that are not None, else ``WEIGHTBUS_*`` variables (``ENV``), else the
        ``nats`` CLI's ``NATS_*`` variables (``NATS_ENV``), else the context ``context`` (a name, or one
        already loaded; by default the one ``NATS_CONTEXT`` names). See ``from_sources`` for how the last two
        fill in.

        Raises:
            BusConfigError: ``WEIGHTBUS_REPLICAS`` is not an integer, the context cannot be read, or the
                combination is invalid.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field, var in ENV.items():
            raw = env.get(var)
            if raw:
                values[field] = raw
        if "replicas" in values:
            try:
                values["replicas"] = int(values["replicas"])
            except ValueError:
                raise BusConfigError(f"{ENV['replicas']} must be an integer, not {values['replicas']!r}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_sources(values, env, context=context)

    @classmethod
    def from_sources(
        cls,
        given: Mapping[str, Any],
        environ: Mapping[str, str] | None = None,
        *,
        context: str | NatsContext | None = None,
    ) -> ConnectOptions:
        """Options from ``given`` (explicit values and ``WEIGHTBUS_*`` variables, already merged; None is unset),
        then the ``NATS_*`` variables of ``environ``, then the context.

        The ``NATS_*`` variables, then the context, each fill what is still unset, group by group: their
        credential (creds, NKEY, token, user, password) only when no credential is set yet, their client
        certificate and key only when neither is set, their CA only when none is set. A user without a
        password from either is a token (the ``nats`` CLI's "Username or Token").

        Raises:
            BusConfigError: the context cannot be read, or the combination is invalid.
        """
        env = os.environ if environ is None else environ
        values = {k: v for k, v in given.items() if v is not None}
        from_nats_env = {field: env[var] for field, var in NATS_ENV.items() if env.get(var)}
        values = _fill(values, _token_from_user(from_nats_env))
        ctx = _context(context, env)
        if ctx is not None:
            values = _fill(values, ctx.values)
        return cls(**values)

    def secrets(self, url: str = "") -> list[str]:
        """Every secret string these options (and the userinfo of ``url``) carry, longest first."""
        found = [s for s in (self.password, self.token) if s]
        found.extend(_url_secrets(url))
        return sorted({s for s in found if len(s) >= 1}, key=len, reverse=True)

    def redact(self, text: str, url: str = "") -> str:
        """``text`` with URL userinfo and every secret of these options (and of ``url``) replaced by ``***``."""
        out = redact_url(text)
        for secret in self.secrets(url):
            out = out.replace(secret, _MASK)
        return out

    def requires_tls(self, url: str = "") -> bool:
        """Whether a connection to ``url`` must be encrypted: a TLS option is set, or a server URL is ``tls://``.

        A connection that must be encrypted and is not is refused before any credential is sent.
        """
        if self.tls_ca is not None or self.tls_cert is not None:
            return True
        return any(part.strip().lower().startswith("tls://") for part in url.split(","))

    def check_files(self) -> None:
        """Fail early, naming the option, when a file it names does not exist.

        Raises:
            BusConfigError: a creds, seed, CA, certificate or key file is missing.
        """
        for field in ("creds", "nkey_seed", "tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, field)
            if path is not None and not Path(path).is_file():
                flag = "nkey" if field == "nkey_seed" else field.replace("_", "-")
                raise BusConfigError(f"--{flag} file not found: {path}")

    def tls_context(self) -> ssl.SSLContext | None:
        """An ``ssl.SSLContext`` trusting ``tls_ca`` (plus the client certificate), or None without TLS options.

        Raises:
            BusConfigError: a PEM file could not be loaded.
        """
        if self.tls_ca is None and self.tls_cert is None:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise BusConfigError(f"--tls-ca {self.tls_ca}: not a readable PEM CA certificate ({exc})") from None
        if self.tls_cert is not None and self.tls_key is not None:
            try:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise BusConfigError(
                    f"--tls-cert {self.tls_cert} / --tls-key {self.tls_key}: not a readable PEM certificate and key"
                    f" ({exc})"
                ) from None
        return ctx

    def nats_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.aio.client.Client.connect``.

        Raises:
            BusConfigError: a file is missing, or creds/NKEY are asked for without the ``nkeys`` package.
        """
        self.check_files()
        kwargs: dict[str, Any] = {}
        if self.creds is not None or self.nkey_seed is not None:
            try:
                # nkeys ships no type hints; it is imported only to tell whether it is installed.
                import nkeys  # type: ignore[import-untyped]  # noqa: F401
            except ImportError:
                raise BusConfigError(
                    "creds files and NKEY seeds need the nkeys package: pip install 'weightbus[auth]'"
                ) from None
        if self.creds is not None:
            kwargs["user_credentials"] = self.creds
        if self.nkey_seed is not None:
            kwargs["nkeys_seed"] = self.nkey_seed
        if self.token is not None:
            kwargs["token"] = self.token
        if self.user is not None:
            kwargs["user"] = self.user
            kwargs["password"] = self.password or ""
        tls = self.tls_context()
        if tls is not None:
            kwargs["tls"] = tls
        return kwargs
