"""Pluggable language models for the CPU reference engine, and the deterministic pure-Python ``HashModel``.

A failed load raises ``ValueError`` and keeps the old weights; every model shares ``VOCAB``; no torch here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

__all__ = ["VOCAB", "EngineModel", "HashModel", "decode", "encode"]

#: The shared character vocabulary: token id ``i`` is ``VOCAB[i]``. Unknown characters encode as ``?``.
VOCAB = " abcdefghijklmnopqrstuvwxyz0123456789.,!?'-\n"
_INDEX = {char: i for i, char in enumerate(VOCAB)}
_UNKNOWN = _INDEX["?"]
# The hash model looks at this many trailing tokens, like a tiny n-gram model.
_CONTEXT = 8


def encode(text: str) -> list[int]:
    """Token ids of ``text`` in :data:`VOCAB` (case-folded; unknown characters become ``?``)."""
    return [_INDEX.get(char, _UNKNOWN) for char in text.lower()]


def decode(ids: Sequence[int]) -> str:
    """Text of token ids; ids must be in ``range(len(VOCAB))``."""
    return "".join(VOCAB[i] for i in ids)


class EngineModel(Protocol):
    """What the reference engine needs from a model."""

    name: str
    """Reported as ``model_path`` until a disk load replaces it."""
    architecture: str
    """Reported in ``/model_info`` ``architectures``."""

    @property
    def vocab_size(self) -> int: ...

    def next_token(self, context: Sequence[int], adapter: str | None) -> int:
        """The greedy next token after ``context``; ``adapter`` is the loaded LoRA path in use, if any."""
        ...

    def load_from_disk(self, path: str, load_format: str | None) -> None:
        """Replace the weights from ``path``. Raises ``ValueError``; the old weights stay on failure."""
        ...

    def load_from_tensors(self, payloads: Sequence[str], load_format: str | None) -> None:
        """Replace (some) weights from serialized payloads. Raises ``ValueError`` on failure."""
        ...

    def load_from_distributed(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[list[int]]) -> None:
        """Receive a broadcast of named tensors. Raises ``ValueError`` when the model cannot."""
        ...


class HashModel:
    """A deterministic stand-in LM: the next token is a hash of the weights' fingerprint and the context.

    Its "weights" are a fingerprint string: a disk load takes the path itself as the new fingerprint (no file
    is read), tensor and distributed loads hash their payloads. Different weights therefore generate
    different text, which lets tests see that an update reached the engine.

    Args:
        fingerprint: the initial weights.
    """

    name = "weightbus/hash-lm"
    architecture = "HashLM"

    def __init__(self, fingerprint: str = "init") -> None:
        self.fingerprint = fingerprint

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)

    def next_token(self, context: Sequence[int], adapter: str | None) -> int:
        digest = hashlib.blake2b(digest_size=8)
        digest.update(self.fingerprint.encode())
        digest.update(b"\0" + (adapter or "").encode() + b"\0")
        digest.update(bytes(token % 256 for token in context[-_CONTEXT:]))
        return int.from_bytes(digest.digest(), "big") % len(VOCAB)

    def load_from_disk(self, path: str, load_format: str | None) -> None:
        if not path:
            raise ValueError("model_path is empty")
        self.fingerprint = path

    def load_from_tensors(self, payloads: Sequence[str], load_format: str | None) -> None:
        if not payloads:
            raise ValueError("serialized_named_tensors is empty")
        self.fingerprint = _hash_parts(["tensor", *payloads])

    def load_from_distributed(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[list[int]]) -> None:
        self.fingerprint = _hash_parts(["distributed", *names, *dtypes, *(repr(shape) for shape in shapes)])


def _hash_parts(parts: Sequence[str]) -> str:
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()
