"""``install(args)``: check the slime it finds, then patch every Megatron weight updater to run under weightbus.

All or nothing (``integrations.host.install``): anything the patches rely on that is missing or different raises
``InstallError`` (a silent bus ``BusConnectError``) before anything is patched; ``uninstall()`` restores every
method. What is slime's own here: its targets, its commit, and the one mode it refuses (a full update over disk,
whose engines slime reloads from its driver). docs/integrations/slime.md#the-trainer-half.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Final

from weightbus.errors import InstallError
from weightbus.integrations.host.install import Installer, Target, globals_runtime
from weightbus.integrations.host.runtime import Runtime
from weightbus.integrations.host.trainer import DELTA
from weightbus.integrations.slime.config import SlimeSettings
from weightbus.integrations.slime.trainer import SLIME, SLIME_COMMIT, SlimeTrainer

__all__ = ["MEGATRON_TARGETS", "SLIME_COMMIT", "install", "installed", "uninstall"]

_UW: Final = "slime.backends.megatron_utils.update_weight"
_DISTRIBUTED: Final = f"{_UW}.update_weight_from_distributed"
_TENSOR: Final = f"{_UW}.update_weight_from_tensor"
_DELTA: Final = f"{_UW}.update_weight_from_disk_delta"

_SELF: Final = ("self",)
_CONNECT: Final = (
    "connect_rollout_engines",
    (
        "self",
        "rollout_engines",
        "rollout_engine_lock",
        "engine_gpu_counts",
        "engine_gpu_offsets",
        "engine_parallel_configs",
    ),
)

#: The engine a slime update talks to (every slime push is a full one: no adapter name is ever sent).
_NO_ADAPTER: Final = "slime_lora"

MEGATRON_TARGETS: Final = (
    Target(_DISTRIBUTED, "UpdateWeightFromDistributed", "distributed", True, (("update_weights", _SELF), _CONNECT)),
    Target(_TENSOR, "UpdateWeightFromTensor", "tensor", True, (("update_weights", _SELF), _CONNECT)),
    Target(
        _DELTA,
        "UpdateWeightFromDiskDelta",
        DELTA,
        True,
        (("update_weights", _SELF), ("_capture_baseline", _SELF), ("_reload_engines", _SELF), _CONNECT),
        lazy=True,  # slime imports it only for --update-weight-mode delta (it needs zstandard)
    ),
)


def _runtime(module: ModuleType) -> tuple[Runtime | None, list[str]]:
    runtime, missing, _ = globals_runtime(module, _NO_ADAPTER)
    return runtime, missing  # slime has no cells: a fenced actor never claims again (a new one does)


_INSTALLER: Final = Installer(SLIME, SlimeTrainer, SlimeSettings, _runtime)


def installed() -> SlimeTrainer | None:
    """The process' installed integration, or None."""
    return _INSTALLER.installed()


def install(args: Any) -> SlimeTrainer:
    """slime's ``--custom-megatron-init-path`` entry point: put weightbus in charge of every Megatron updater.

    slime calls it on every rank of every training actor (``initialize.py:100-104``); a second call in the same
    process returns the first install. Rank 0 connects to the bus here, so an unreachable bus fails the
    actor's init.

    Args:
        args: slime's argument namespace (settings: ``weightbus.integrations.slime.config``).

    Returns:
        The installed integration.

    Raises:
        InstallError: a class, method, signature or module global the patches rely on is missing or
            different, or the run updates full weights over disk (nothing was patched).
        ValueError: no policy, or a setting that is not valid.
        BusConnectError: rank 0 could not reach NATS within the connect timeout (nothing was patched).
    """
    if (
        getattr(args, "update_weight_transport", None) == "disk"
        and getattr(args, "update_weight_mode", "full") == "full"
    ):
        raise InstallError(
            "slime",
            SLIME.checked,
            [
                "--update-weight-transport disk with --update-weight-mode full: slime reloads those engines from "
                "its driver (slime.ray.actor_group.RayTrainGroup._reload_rollout_weights_from_disk, labelled with "
                "the driver's own count), a process --custom-megatron-init-path does not reach, so weightbus "
                "cannot label them with its number; use --update-weight-transport nccl, --colocate, or "
                "--update-weight-mode delta"
            ],
        )
    return _INSTALLER.install(args, MEGATRON_TARGETS)


def uninstall() -> None:
    """Restore every patched method and close the bus (tests, notebooks)."""
    _INSTALLER.uninstall()
