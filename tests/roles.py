"""The shipped NATS roles (``ops/nats/auth.conf``) for tests: passwords, and a server running them with the stream.

``tests/bus/test_roles.py`` tests the roles themselves; the loop, admission and counter-mark tests run their
processes under them through ``roles_server``. The trainer and rollout roles are per policy (``policy-a``,
``policy-b``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from weightbus.bus import ConnectOptions, connect
from weightbus.bus.stream import StreamRequirements, create_or_upgrade
from weightbus.embedded.server import EmbeddedNats

AUTH_CONF = Path(__file__).parents[1] / "ops" / "nats" / "auth.conf"
PASSWORDS = {
    "trainer-policy-a": "tra-pw-1",
    "rollout-policy-a": "roa-pw-2",
    "trainer-policy-b": "trb-pw-3",
    "rollout-policy-b": "rob-pw-4",
    "monitor": "mo-pw-5",
    "admin": "ad-pw-6",
}
POLICIES = ("policy-a", "policy-b")
"""The policies the shipped file has roles for (``trainer-<policy>``, ``rollout-<policy>``)."""


def password_env(user: str) -> str:
    """The environment variable that holds ``user``'s password in the shipped file (``TRAINER_POLICY_A_PASSWORD``)."""
    return user.upper().replace("-", "_") + "_PASSWORD"


ENV = {password_env(user): password for user, password in PASSWORDS.items()}


async def _create_stream(url: str) -> None:
    admin = await connect(url, options=ConnectOptions(user="admin", password=PASSWORDS["admin"]), ensure_stream=False)
    try:
        await create_or_upgrade(admin.js, "WEIGHTBUS", StreamRequirements(), replicas=1)
    finally:
        await admin.aclose()


@contextmanager
def roles_server(store: Path, *, config: Path = AUTH_CONF, env: dict[str, str] | None = None) -> Iterator[EmbeddedNats]:
    """A nats-server on the shipped roles (or ``config``), its ``WEIGHTBUS`` stream created by the admin role."""
    with EmbeddedNats(config=config, env=ENV if env is None else env, store_dir=store) as srv:
        asyncio.run(_create_stream(srv.url))
        yield srv
