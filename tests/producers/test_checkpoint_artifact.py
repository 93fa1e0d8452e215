"""Checkpoint directories as artifacts: what SGLang's ``update_weights_from_disk`` loads (config, shards, tokenizer).

The manifest digest must be what the documented shell recipe prints, every file below the directory must count, and
a check must see any file written, added or removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from weightbus.producers.artifact import (
    CheckedArtifact,
    check_artifact,
    checkpoint_artifact,
    safetensors_tensor_digests,
)
from weightbus.schemas import WeightArtifact

from .conftest import write_checkpoint, write_safetensors


def test_the_manifest_digest_is_what_the_documented_shell_recipe_prints(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path / "ckpt")
    os.symlink(root / "config.json", root / "generation_config.json")  # an HF cache snapshot is made of links
    os.symlink(root, root / "tokenizer" / "loop")  # a link back up: never walked forever, skipped as find -L does
    os.symlink(root / "gone.bin", root / "dangling.bin")  # a broken link and a fifo are no files
    os.mkfifo(root / "fifo")
    recipe = "find -L . -type f | sed 's|^\\./||' | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum"
    printed = subprocess.run(["bash", "-c", recipe], cwd=root, capture_output=True, text=True, check=True).stdout
    assert checkpoint_artifact(root).manifest_digest == "sha256:" + printed.split()[0]


def test_a_checkpoint_passes_its_check_and_any_file_changed_added_or_removed_fails_it(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path / "ckpt")
    announced = checkpoint_artifact(root)
    assert announced.tensors == () and announced.lineage == "full"
    assert isinstance(check_artifact(announced), CheckedArtifact)
    write_safetensors(root / "model-00001-of-00002.safetensors", 7)  # same size, other weights
    assert check_artifact(announced)[0] == "digest_mismatch"  # type: ignore[index]
    root = write_checkpoint(tmp_path / "ckpt2")
    announced = checkpoint_artifact(root)
    (root / "tokenizer" / "merges.txt").write_text("x")
    assert check_artifact(announced)[0] == "digest_mismatch"  # type: ignore[index]
    (root / "tokenizer" / "merges.txt").unlink()
    (root / "config.json").unlink()
    assert check_artifact(announced)[0] == "digest_mismatch"  # type: ignore[index]
    shutil.rmtree(root)
    assert check_artifact(announced)[0] == "missing_file"  # type: ignore[index]


def test_tensor_digests_span_the_shards_and_a_name_in_two_shards_is_refused(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path / "ckpt")
    announced = checkpoint_artifact(root, tensors=True)
    assert [name for name, _ in announced.tensors] == ["v", "w"]
    assert isinstance(check_artifact(announced), CheckedArtifact)
    forged = WeightArtifact(
        uri=announced.uri, manifest_digest=announced.manifest_digest, tensors=(("v", "sha256:" + "0" * 64),)
    )
    assert check_artifact(forged)[0] == "digest_mismatch"  # type: ignore[index]
    write_safetensors(root / "extra.safetensors", 3)  # a second "w"
    with pytest.raises(ValueError, match="two files"):
        safetensors_tensor_digests(root)


def test_a_checked_checkpoint_names_the_file_that_moved(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path / "ckpt")
    checked = check_artifact(checkpoint_artifact(root))
    assert isinstance(checked, CheckedArtifact) and checked.changed() is None
    os.replace(write_safetensors(tmp_path / "next.safetensors", 2), root / "model-00001-of-00002.safetensors")
    assert "model-00001-of-00002.safetensors" in (checked.changed() or "")


def test_a_file_is_nowrite_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        checkpoint_artifact(write_safetensors(tmp_path / "w.safetensors", 1))
