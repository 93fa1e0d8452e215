r"""The checksums of a weights artifact on disk: written by the trainer, checked by a catch-up before any load.

One definition of the digests, used on both sides. An artifact is one file (a safetensors file) or a checkpoint
directory (what SGLang's ``update_weights_from_disk`` loads: ``config.json``, the safetensors shards, the tokenizer).
``WeightArtifact.manifest_digest`` is ``sha256:`` of a file's bytes; of a directory, it is ``sha256:`` of its
manifest, one ``"<sha256 hex>  <path>\n"`` line per regular file below it (symbolic links followed, paths relative
and ``/``-separated, in byte order): what ``sha256sum`` prints for those files, so ``cd DIR && find -L . -type f |
sed 's|^\./||' | LC_ALL=C sort | xargs -d '\n' sha256sum | sha256sum`` gives the same hex. ``tensors``: the sha256
of each tensor's bytes in the safetensors files, as the format's header indexes them (names unique across shards).
Files are read in chunks, never whole, and no torch is needed. ``check_artifact`` says what is wrong, or returns the
``CheckedArtifact``; ``verify_artifact`` only says what is wrong.

The engine reads the files again after the check, so a check alone proves nothing about what it loads: a trainer
that writes every version to one path can rewrite it in between. A ``CheckedArtifact`` keeps the identity of every
file as it was before their bytes were hashed (device, inode, size, modification and change times, in ns);
``changed()`` compares it with the files' now. A rewrite, a replace, an added or a removed file moves it, even with
the same bytes, so the check errs toward "changed".
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final, Literal
from urllib.parse import unquote, urlparse

from weightbus.schemas import WeightArtifact

__all__ = [
    "ArtifactProblem",
    "CheckedArtifact",
    "check_artifact",
    "checkpoint_artifact",
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
    try:
        header = json.loads(f.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file: the header is not an object")
    start = 8 + length
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise ValueError(f"not a safetensors file: the tensor {name!r} has no data_offsets [begin, end]")
        yield name, start + offsets[0], start + offsets[1]


def _members(path: Path) -> list[tuple[str, Path]]:
    """The regular files an artifact is made of, as ``(name, path)``: the file itself (named ``""``), or every regular
    file below a checkpoint directory (its relative ``/``-separated path; links followed, a link back to a directory
    above skipped, as ``find -L`` does), in byte order of the names.

    Raises:
        OSError: a directory cannot be listed, or ``path`` is neither a regular file nor a directory (a fifo or a
            device would be read forever).
    """
    if not path.is_dir():
        if path.exists() and not path.is_file():
            raise OSError(f"{path} is neither a regular file nor a directory")
        return [("", path)]
    found: list[tuple[str, Path]] = []
    # A stack, not recursion: a tree of any depth. Each entry carries the directories above it, to skip loops.
    stack: list[tuple[Path, frozenset[tuple[int, int]]]] = [(path, frozenset())]
    while stack:
        directory, above = stack.pop()
        st = directory.stat()
        here = (st.st_dev, st.st_ino)
        if here in above:
            continue  # a loop: walking it would never end
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_dir():
                    stack.append((Path(entry.path), above | {here}))
                elif entry.is_file():  # not a fifo, a socket or a broken link: what `find -L -type f` lists
                    full = Path(entry.path)
                    found.append((full.relative_to(path).as_posix(), full))
    return sorted(found, key=lambda member: os.fsencode(member[0]))  # the file system's bytes, as sort sees them


def safetensors_tensor_digests(path: Path) -> tuple[tuple[str, str], ...]:
    """``(name, "sha256:<hex>")`` of every tensor of the safetensors file at ``path``, or of every ``*.safetensors``
    file below the checkpoint directory ``path``, sorted by name.

    Raises:
        OSError: a file cannot be read.
        ValueError: it is not a safetensors file, or two shards name the same tensor.
    """
    digests: dict[str, str] = {}
    for name, file in _members(path):
        if name and not name.endswith(".safetensors"):
            continue
        with file.open("rb") as f:
            for tensor, start, end in list(_tensor_ranges(f)):
                if tensor in digests:
                    raise ValueError(f"the tensor {tensor!r} is in two files of {path}")
                digests[tensor] = _hash_range(f, start, end)
    return tuple(sorted(digests.items()))


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def _digest(path: Path) -> str:
    """The manifest digest of the file or checkpoint directory at ``path`` (see the module docstring).

    Raises:
        OSError: a file cannot be read.
        ValueError: the directory holds no file, or a name ``sha256sum`` would escape (a backslash or a newline in
            it), so the documented recipe would print another digest.
    """
    members = _members(path)
    if members == [("", path)]:
        return _file_digest(path)
    if not members:
        raise ValueError(f"{path} holds no file: no checkpoint")
    odd = [name for name, _ in members if "\\" in name or "\n" in name]
    if odd:
        raise ValueError(f"{path}: file names with a backslash or a newline are not supported: {odd[:3]}")
    lines = (_file_digest(file).removeprefix("sha256:").encode() + b"  " + os.fsencode(name) for name, file in members)
    manifest = b"".join(line + b"\n" for line in lines)
    return "sha256:" + hashlib.sha256(manifest).hexdigest()


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


def checkpoint_artifact(directory: Path, base: int | None = None, *, tensors: bool = False) -> WeightArtifact:
    """The ``WeightArtifact`` of the checkpoint directory a trainer wrote for SGLang's ``update_weights_from_disk``.

    Its manifest digest covers every regular file below it (module docstring), so a catch-up loads the directory
    only if every file is what the trainer wrote.

    Args:
        directory: the checkpoint directory.
        base: the version a delta is the difference from (None: a full checkpoint).
        tensors: also give each tensor's digest, across the shards. A model of more than a few hundred tensors
            does not fit one announcement (``MAX_EVENT_BYTES``), and the manifest digest covers their bytes anyway.

    Raises:
        OSError: a file cannot be read.
        ValueError: ``directory`` is not a directory, or (``tensors``) a shard is not a safetensors file.
    """
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory (for one safetensors file: safetensors_artifact)")
    return WeightArtifact(
        uri=str(directory.absolute()),  # read by engines and catch-ups whose working directories are not this one
        lineage="full" if base is None else "delta",
        base=base,
        manifest_digest=_digest(directory),
        tensors=safetensors_tensor_digests(directory) if tensors else (),
    )


#: A file's identity without its bytes: device, inode, size, modification and change times (ns).
_Identity = tuple[int, int, int, int, int]


def _identities(path: Path) -> dict[str, _Identity] | None:
    """The identity of every file of the artifact at ``path``, by name; None when one cannot be looked at."""
    try:
        members = _members(path)
        out: dict[str, _Identity] = {}
        for name, file in members:
            st = file.stat()
            out[name] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    except OSError:
        return None
    return out


@dataclass(frozen=True, slots=True)
class CheckedArtifact:
    """An artifact whose bytes matched its digests, and the identity of its files from before they were read.

    Attributes:
        path: the file or checkpoint directory.
        identities: per file (``""`` for a lone file), its device, inode, size, modification and change times (ns).
    """

    path: Path
    identities: dict[str, _Identity]

    @classmethod
    def now(cls, path: Path) -> CheckedArtifact:
        """The identities of ``path``'s files as they are now, to compare after their bytes were read.

        Raises:
            OSError: a file cannot be looked at.
        """
        identities = _identities(path)
        if identities is None:
            raise OSError(f"{path}, or a file of it, cannot be looked at")
        return cls(path, identities)

    def changed(self) -> str | None:
        """Why the files may no longer hold the bytes that were checked (written again, replaced, added, removed, or
        no longer looked at), or None. Never raises: what cannot be told counts as changed."""
        try:
            now = _identities(self.path)
        except Exception as exc:  # counted as a change, never raised: the caller quarantines on it
            return f"{self.path} could not be looked at again: {exc!r}"
        if now is None:
            return f"{self.path} is no longer there, or a file of it"
        if now == self.identities:
            return None
        names = now.keys() | self.identities.keys()
        moved = sorted(name for name in names if now.get(name) != self.identities.get(name))
        which = "" if moved == [""] else f" ({', '.join(moved[:4])}{', ...' if len(moved) > 4 else ''})"
        return f"{self.path} was written, replaced, added to or removed from{which}"


def check_artifact(artifact: WeightArtifact) -> ArtifactProblem | CheckedArtifact:
    """Check the file or directory ``artifact`` names against its digests; the ``CheckedArtifact`` when every
    announced one matches.

    An artifact without a ``manifest_digest`` cannot be checked, so it is refused (``digest_mismatch``): a
    catch-up loads only bytes it verified. Where per-tensor digests are given, every tensor must be there with
    its digest, and no other. Files written while they were read are refused too (``digest_mismatch``).
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
    identities = _identities(path)
    try:
        actual = _digest(path)
    except FileNotFoundError:
        return "missing_file", f"{artifact.uri} does not exist, or a file of it"
    except OSError as exc:
        return "missing_file", f"{artifact.uri} cannot be read: {exc}"
    except ValueError as exc:
        return "unsupported", str(exc)
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
    checked = CheckedArtifact(path, identities) if identities is not None else None
    why = "it could not be looked at" if checked is None else checked.changed()
    if checked is None or why is not None:
        return "digest_mismatch", f"{artifact.uri} changed while it was checked: {why}"
    return checked


def verify_artifact(artifact: WeightArtifact) -> ArtifactProblem | None:
    """What is wrong with the file or directory ``artifact`` names (see ``check_artifact``), or None when it
    matches."""
    checked = check_artifact(artifact)
    return None if isinstance(checked, CheckedArtifact) else checked
