"""Which refusals end a guarded operation: its own (JetStream API publishes, inbox subscriptions), not another's."""

from __future__ import annotations

import asyncio

import pytest

from weightbus.bus._denials import Denials
from weightbus.errors import PermissionDeniedError


def _refusal(kind: str, subject: str) -> str:
    return f'nats: permissions violation for {kind} to "{subject}"'


@pytest.mark.parametrize(
    ("kind", "subject", "matches"),
    [
        ("subscription", "_INBOX.Abc123.*", True),
        ("publish", "$JS.API.STREAM.INFO.WEIGHTBUS", True),
        ("subscription", "weightbus.policy-a.batch", False),  # another task's subscription
        ("publish", "weightbus.policy-a.weights", False),
        ("subscription", "$JS.API.>", False),
    ],
)
def test_api_or_inbox_matches_only_the_operations_own_subjects(kind: str, subject: str, matches: bool) -> None:
    action = "publish" if kind == "publish" else "subscribe"
    assert Denials.api_or_inbox("$JS.API.")(action, subject) is matches


async def test_a_refusal_of_another_subscription_does_not_end_a_jetstream_call() -> None:
    denials = Denials()
    done = asyncio.Event()

    async def op() -> str:
        await done.wait()
        return "created"

    guarded = asyncio.create_task(denials.guard(Denials.api_or_inbox("$JS.API."), op()))
    await asyncio.sleep(0)
    assert denials.record(_refusal("subscription", "weightbus.policy-a.batch")) is True
    await asyncio.sleep(0)
    assert not guarded.done() and denials.last_caught is False
    denials.record(_refusal("subscription", "_INBOX.xyz.*"))
    with pytest.raises(PermissionDeniedError, match="_INBOX.xyz"):
        await guarded
