"""The shipped NATS roles (``ops/nats/auth.conf``) for tests: passwords, and a server running them with the stream.

``tests/bus/test_roles.py`` tests the roles themselves; the loop and admission tests run their processes under
them through ``roles_server``.
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
    "trainer": "tr-pw-1",
    "trainer-policy-a": "tra-pw-2",
    "rollout": "ro-pw-3",
    "monitor": "mo-pw-4",
    "admin": "ad-pw-5",
}
ENV = {
    "TRAINER_PASSWORD": PASSWORDS["trainer"],
    "TRAINER_A_PASSWORD": PASSWORDS["trainer-policy-a"],
    "ROLLOUT_PASSWORD": PASSWORDS["rollout"],
    "MONITOR_PASSWORD": PASSWORDS["monitor"],
    "ADMIN_PASSWORD": PASSWORDS["admin"],
}


async def _create_stream(url: str) -> None:
    admin = await connect(url, options=ConnectOptions(user="admin", password=PASSWORDS["admin"]), ensure_stream=False)
    try:
        await create_or_upgrade(admin.js, "WEIGHTBUS", StreamRequirements(), replicas=1)
    finally:
        await admin.close()


@contextmanager
def roles_server(store: Path) -> Iterator[EmbeddedNats]:
    """A nats-server on the shipped roles, its ``WEIGHTBUS`` stream created by the admin role (no other role may)."""
    with EmbeddedNats(config=AUTH_CONF, env=ENV, store_dir=store) as srv:
        asyncio.run(_create_stream(srv.url))
        yield srv
