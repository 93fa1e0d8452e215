"""How a client reaches and authenticates to NATS: credentials, TLS, and the replicas of a stream it creates.

A secret never reaches a log, an error or a ``repr`` (``redact_url``, ``ConnectOptions.redact``); any TLS option
means TLS or a typed error; a missing file is reported by path before connecting.
"""

from __future__ import annotations

import dataclasses
import os
import re
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from weightbus.errors import BusConfigError

__all__ = ["ENV", "NATS_URL_ENV", "ConnectOptions", "nats_url_from_env", "redact_url"]

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
#: Where a NATS URL is read from, first found wins: weightbus's own variable, then the ``nats`` CLI's.
NATS_URL_ENV: Final = ("WEIGHTBUS_NATS", "NATS_URL")
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


def nats_url_from_env(default: str, environ: Mapping[str, str] | None = None) -> str:
    """The NATS URL of the first non-empty variable of ``NATS_URL_ENV``, else ``default``."""
    env = os.environ if environ is None else environ
    for var in NATS_URL_ENV:
        value = env.get(var)
        if value:
            return value
    return default


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
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ConnectOptions:
        """Options from ``WEIGHTBUS_*`` variables (see ``ENV``); keyword arguments that are not None win.

        Raises:
            BusConfigError: ``WEIGHTBUS_REPLICAS`` is not an integer, or the combination is invalid.
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
