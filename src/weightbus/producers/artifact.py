"""The checksums of a weights artifact on disk: written by the trainer, checked by a catch-up before any load.

One definition of the digests (``WeightArtifact.manifest_digest``: ``sha256:`` of the file's bytes; ``tensors``: the
sha256 of each tensor's bytes in a safetensors file, as the format's header indexes them), used on both sides.
Files are read in chunks, never whole, and no torch is needed. ``check_artifact`` says what is wrong, or returns the
``CheckedFile``; ``verify_artifact`` only says what is wrong.

The engine reads the file again after the check, so a check alone proves nothing about what it loads: a trainer that
writes every version to one path can rewrite it in between. A ``CheckedFile`` keeps the file's identity as it was
before its bytes were hashed (device, inode, size, modification and change times, in ns); ``changed()`` compares it
with the file's now. A rewrite or a replace moves it, even with the same bytes, so the check errs toward "changed".
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final, Literal
from urllib.parse import unquote, urlparse

from weightbus.schemas import WeightArtifact

__all__ = [
    "ArtifactProblem",
    "CheckedFile",
    "check_artifact",
    "local_path",
    "safetensors_artifact",
    "safetensors_tensor_digests",
    "verify_artifact",
]

_CHUNK: Final = 1 << 20
#: A safetensors header larger than this is refused (the format's own readers cap it at 100 MB).
_MAX_HEADER: Final = 100 * 1024 * 1024

#: Why an artifact cannot be loaded: its file is not there, or its bytes are not what was announced.
ArtifactProblem = tuple[Literal["missing_file", "digest_mismatch", "unsupported"], str]


def local_path(uri: str) -> Path | None:
    """The local path ``uri`` names (a plain path or a ``file://`` URI), or None for any other scheme."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and uri[1:2] == ":"):  # a path (a Windows drive letter too)
        return Path(uri)
    return None


def _hash_range(f: BinaryIO, start: int, end: int) -> str:
    digest = hashlib.sha256()
    f.seek(start)
    left = end - start
    while left > 0:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            raise ValueError("the file ends inside a tensor")
        digest.update(chunk)
        left -= len(chunk)
    return "sha256:" + digest.hexdigest()


def _tensor_ranges(f: BinaryIO) -> Iterator[tuple[str, int, int]]:
    head = f.read(8)
    if len(head) != 8:
        raise ValueError("not a safetensors file: shorter than its header length")
    (length,) = struct.unpack("<Q", head)
    if length > _MAX_HEADER:
        raise ValueError(f"not a safetensors file: a {length}-byte header")
    header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file: the header is not an object")
    start = 8 + length
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        first, last = meta["data_offsets"]
        yield name, start + int(first), start + int(last)


def safetensors_tensor_digests(path: Path) -> tuple[tuple[str, str], ...]:
    """``(name, "sha256:<hex>")`` of every tensor of the safetensors file at ``path``, sorted by name.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a safetensors file.
    """
    with path.open("rb") as f:
        ranges = list(_tensor_ranges(f))
        return tuple(sorted((name, _hash_range(f, start, end)) for name, start, end in ranges))


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def safetensors_artifact(path: Path, base: int | None = None) -> WeightArtifact:
    """The ``WeightArtifact`` of the safetensors file at ``path``: ``full``, or a ``delta`` on ``base``.

    The manifest digest is the file's sha256; each tensor's is the sha256 of its bytes in the file (the
    format's 8-byte little-endian header length, its JSON header, then the data the offsets index), so a
    replica checks what it loads without torch.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a safetensors file.
    """
    return WeightArtifact(
        uri=str(path),
        lineage="full" if base is None else "delta",
        base=base,
        manifest_digest=_file_digest(path),
        tensors=safetensors_tensor_digests(path),
    )


#: A file's identity without its bytes: device, inode, size, modification and change times (ns).
_Identity = tuple[int, int, int, int, int]


def _identity(path: Path) -> _Identity | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True, slots=True)
class CheckedFile:
    """A file whose bytes matched an artifact's digests, and its identity from before they were read.

    Attributes:
        path: the file.
        identity: device, inode, size, modification and change times (ns) before its bytes were hashed.
    """

    path: Path
    identity: _Identity

    def changed(self) -> str | None:
        """Why the file may no longer hold the bytes that were checked (written again, replaced, removed), or None."""
        now = _identity(self.path)
        if now is None:
            return f"{self.path} is no longer there"
        if now != self.identity:
            return f"{self.path} was written or replaced (its inode, size or times moved)"
        return None


def check_artifact(artifact: WeightArtifact) -> ArtifactProblem | CheckedFile:
    """Check the file ``artifact`` names against its digests; the ``CheckedFile`` when every announced one matches.

    An artifact without a ``manifest_digest`` cannot be checked, so it is refused (``digest_mismatch``): a
    catch-up loads only bytes it verified. Where per-tensor digests are given, every tensor must be there with
    its digest, and no other. A file written while it was read is refused too (``digest_mismatch``).
    """
    path = local_path(artifact.uri)
    if path is None:
        return "unsupported", f"{artifact.uri!r} is not a local path or file:// URI: its bytes cannot be checked here"
    expected = artifact.manifest_digest
    if expected is None:
        return "digest_mismatch", f"{artifact.uri} was announced without a manifest digest: nothing to check it by"
    algorithm = expected.split(":", 1)[0]
    if algorithm != "sha256":
        return "digest_mismatch", f"{artifact.uri}: cannot check a {algorithm!r} digest (only sha256)"
    identity = _identity(path)
    try:
        actual = _file_digest(path)
    except FileNotFoundError:
        return "missing_file", f"{artifact.uri} does not exist"
    except OSError as exc:
        return "missing_file", f"{artifact.uri} cannot be read: {exc}"
    if actual != expected:
        return "digest_mismatch", f"{artifact.uri} is {actual}, announced as {expected}"
    if artifact.tensors:
        try:
            tensors = safetensors_tensor_digests(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return "digest_mismatch", f"{artifact.uri}: its tensors cannot be read: {exc}"
        if tensors != tuple(sorted(artifact.tensors)):
            differ = sorted(set(tensors) ^ set(artifact.tensors))
            return "digest_mismatch", f"{artifact.uri}: tensor digests differ from the announced ones: {differ[:4]}"
    checked = CheckedFile(path, identity) if identity is not None else None
    why = "it could not be looked at" if checked is None else checked.changed()
    if checked is None or why is not None:
        return "digest_mismatch", f"{artifact.uri} changed while it was checked: {why}"
    return checked


def verify_artifact(artifact: WeightArtifact) -> ArtifactProblem | None:
    """What is wrong with the file ``artifact`` names (see ``check_artifact``), or None when it matches."""
    checked = check_artifact(artifact)
    return None if isinstance(checked, CheckedFile) else checked
