"""Early abort for slime: the generate function (``--custom-generate-function-path``) that names each request.

It calls the wrapped generate function (``WEIGHTBUS_GENERATE_FUNCTION``, by default slime's) with the sample
unchanged, while the request it sends carries weightbus' ``rid``: slime's payload has no ``rid`` field, so slime's
``post`` in ``slime.rollout.sglang_rollout`` is wrapped once to add it to ``/generate`` bodies that have none (and to
read the answer's per-token version spans, which slime drops: the oldest becomes one more of the sample's labels). A
group that ``rules.abort`` finds certain to be stale has its unfinished requests aborted by rid on every engine
(``consumers.inflight``); they come back ``ABORTED``, slime's worker hands the group back, and the drain engine
counts and recycles it. Only certainty aborts; a failed abort changes nothing. docs/integrations/slime.md.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Final

from weightbus.consumers.inflight import oldest_label
from weightbus.integrations.host.settings import setting
from weightbus.integrations.slime.rollout import active_rollout
from weightbus.schemas.rollouts import parse_version

__all__ = ["DEFAULT_GENERATE", "forget_functions", "generate", "request_id"]

log = logging.getLogger("weightbus.integrations.slime")

#: slime's own generate function, wrapped unless ``WEIGHTBUS_GENERATE_FUNCTION`` names another.
DEFAULT_GENERATE: Final = "slime.rollout.sglang_rollout.generate"
_RID: ContextVar[str | None] = ContextVar("weightbus_slime_rid", default=None)
# The oldest version each answer of the request names, its per-token spans included (slime keeps only the last).
_OLDEST: ContextVar[list[int] | None] = ContextVar("weightbus_slime_oldest", default=None)
_inner: dict[str, Callable[..., Any]] = {}


def request_id() -> str | None:
    """The ``rid`` weightbus gave the request being generated now, or None.

    slime's own generate function sends it; a generate function of yours that posts ``/generate`` itself (not
    through ``slime.rollout.sglang_rollout.post``) adds ``"rid": request_id()`` to its payload to be abortable.
    """
    return _RID.get()


def forget_functions() -> None:
    """Forget the generate functions loaded so far (a reloaded slime loads them again)."""
    _inner.clear()


def _generate_function(args: Any) -> Callable[..., Any]:
    path = setting(args, "weightbus_generate_function", "WEIGHTBUS_GENERATE_FUNCTION", DEFAULT_GENERATE)
    assert path is not None
    fn = _inner.get(path)
    if fn is None:
        from slime.utils.misc import load_function  # type: ignore[import-not-found]

        fn = load_function(path)
        if fn is None:
            raise ValueError(f"WEIGHTBUS_GENERATE_FUNCTION {path!r} names no function")
        _inner[path] = fn
    return fn


def _name_requests() -> None:
    """Wrap slime's ``post`` (``slime.rollout.sglang_rollout``) once: ``/generate`` bodies get the ``rid``."""
    import slime.rollout.sglang_rollout as sglang_rollout  # type: ignore[import-not-found]

    original = sglang_rollout.post
    if getattr(original, "__weightbus_rid__", False):
        return

    async def post(url: str, payload: Any, *args: Any, **kwargs: Any) -> Any:
        rid = _RID.get()
        if rid is not None and isinstance(payload, dict) and url.endswith("/generate") and "rid" not in payload:
            payload = {**payload, "rid": rid}
        out = await original(url, payload, *args, **kwargs)
        seen = _OLDEST.get()
        if seen is not None and isinstance(out, dict) and isinstance(out.get("meta_info"), dict):
            label = oldest_label(out["meta_info"])
            if label is not None:
                seen.append(label)
        return out

    post.__weightbus_rid__ = True  # type: ignore[attr-defined]
    post.__wrapped__ = original  # type: ignore[attr-defined]
    sglang_rollout.post = post


async def _call(fn: Callable[..., Any], args: Any, sample: Any, sampling_params: Any, evaluation: bool) -> Any:
    # As slime calls a custom generate function: ``evaluation`` only when its signature has it.
    if "evaluation" in inspect.signature(fn).parameters:
        return await fn(args, sample, sampling_params, evaluation=evaluation)
    return await fn(args, sample, sampling_params)


def _label_oldest(samples: list[Any], oldest: int) -> None:
    """Give each sample the oldest version its answers named: slime keeps one label per call, the engine's at the
    end, and a call that spanned an update would be judged fresher than its first tokens."""
    for sample in samples:
        labels = getattr(sample, "weight_versions", None)
        if not isinstance(labels, list):
            continue
        known = [v for v in (parse_version(str(label)) for label in labels) if v is not None]
        if not known or oldest < min(known):
            labels.append(str(oldest))


async def generate(args: Any, sample: Any, sampling_params: Any, evaluation: bool = False) -> Any:
    """slime's custom generate contract (``(args, sample, sampling_params) -> Sample | list[Sample]``), abortable.

    A sample of a group handed out by ``generate_rollout`` is generated under its own ``rid``; when it answers,
    its labels (``Sample.weight_versions``) are checked: a group certain to be stale has its other requests
    aborted. Any other sample (evaluation, or no weightbus rollout function in this process) is generated as is.
    """
    inner = _generate_function(args)
    session = active_rollout()
    found = session.request(sample) if session is not None and not evaluation else None
    if session is None or found is None:
        return await _call(inner, args, sample, sampling_params, evaluation)
    flight, index = found
    _name_requests()
    seen: list[int] = []
    token, spans = _RID.set(flight.rids[index]), _OLDEST.set(seen)
    try:
        out = await _call(inner, args, sample, sampling_params, evaluation)
    finally:
        _RID.reset(token)
        _OLDEST.reset(spans)
    samples = out if isinstance(out, list) else [out]
    if seen:
        _label_oldest(samples, min(seen))
    labels = [label for s in samples for label in (getattr(s, "weight_versions", None) or [])]
    session.post(lambda: session.finished(flight, index, labels))
    return out
