"""``install(args)``: check the miles it finds, then patch every weight updater to run under weightbus.

All or nothing (``integrations.host.install``): anything the patches rely on that is missing or different raises
``InstallError`` (a silent bus ``BusConnectError``) before anything is patched; ``uninstall()`` restores every
method. What is miles' own here: its targets, its commit, and where its group puts a cell (``_standing``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final

from weightbus.integrations.host.install import Installer, Target, globals_runtime
from weightbus.integrations.host.runtime import Runtime
from weightbus.integrations.miles.config import MilesSettings
from weightbus.integrations.miles.trainer import LORA_NAME, MILES, MILES_COMMIT, MilesTrainer
from weightbus.schemas import ClaimStanding

__all__ = [
    "FSDP_TARGETS",
    "MEGATRON_TARGETS",
    "MILES",
    "MILES_COMMIT",
    "install",
    "install_fsdp",
    "installed",
    "uninstall",
]

log = logging.getLogger("weightbus.integrations.miles")

_UW: Final = "miles.backends.megatron_utils.update_weight"
_MIXIN: Final = f"{_UW}.update_weight_from_distributed.mixin"
_BROADCAST: Final = f"{_UW}.update_weight_from_distributed.broadcast"
_P2P: Final = f"{_UW}.update_weight_from_distributed.p2p"
_DELTA: Final = f"{_UW}.update_weight_from_distributed.delta"
_TENSOR: Final = f"{_UW}.update_weight_from_tensor"
_FSDP: Final = "miles.backends.fsdp_utils.update_weight_utils"

_CONNECT: Final = ("rollout_engines", "rollout_engine_lock", "engine_gpu_counts", "engine_gpu_offsets")


_SELF: Final = ("self",)

MEGATRON_TARGETS: Final = (
    Target(
        _MIXIN,
        "DistBucketedWeightUpdateMixin",
        "mixin",
        True,
        (
            ("update_weights", _SELF),
            ("_pause_and_prepare_engines", _SELF),
            ("_finalize_and_resume_engines", _SELF),
            ("_update_lora_weights", _SELF),
            ("_update_multi_lora_weights", _SELF),
        ),
    ),
    Target(
        _BROADCAST,
        "UpdateWeightFromDistributed",
        "mixin",
        False,
        (("connect_rollout_engines", ("self", *_CONNECT)),),
        inherits="DistBucketedWeightUpdateMixin",
    ),
    Target(
        _P2P,
        "UpdateWeightP2P",
        "mixin",
        False,
        (("connect_rollout_engines", ("self", *_CONNECT)),),
        inherits="DistBucketedWeightUpdateMixin",
    ),
    Target(
        _DELTA,
        "UpdateWeightFromDiskDelta",
        "delta",
        True,
        (
            ("update_weights", _SELF),
            ("_capture_baseline", _SELF),
            ("_reload_engines", _SELF),
            ("connect_rollout_engines", ("self", *_CONNECT)),
        ),
        lazy=True,
    ),
    Target(
        _TENSOR,
        "UpdateWeightFromTensor",
        "tensor",
        True,
        (("update_weights", _SELF), ("connect_rollout_engines", ("self", *_CONNECT))),
    ),
)

FSDP_TARGETS: Final = (
    Target(
        _FSDP,
        "UpdateWeight",
        "fsdp",
        True,
        (("update_weights", _SELF), ("connect_rollout_engines", ("self", *_CONNECT))),
    ),
    Target(_FSDP, "UpdateWeightFromTensor", "fsdp", False, (), inherits="UpdateWeight"),
    Target(_FSDP, "UpdateWeightFromDistributed", "fsdp", False, (), inherits="UpdateWeight"),
)


def _runtime(module: ModuleType) -> tuple[Runtime | None, list[str]]:
    runtime, missing, names = globals_runtime(module, LORA_NAME)
    if runtime is None:
        return None, missing
    lora = names.get("LORA_ADAPTER_NAME")
    # Optional: where miles' group put the cell (only a cell miles picked again claims again once fenced).
    state, context = names.get("get_parallel_state"), getattr(names.get("ray"), "get_runtime_context", None)
    standing = None
    if callable(state) and callable(context):
        standing = functools.partial(_standing, state, context)
    return Runtime(
        runtime.dist,
        runtime.gloo,
        runtime.ray_get,
        lora if isinstance(lora, str) else LORA_NAME,
        standing_of=standing,
    ), []


def _standing(parallel_state: Callable[[], Any], runtime_context: Callable[[], Any]) -> ClaimStanding | None:
    """Where miles' group puts this cell now: its driver's Ray job, its quorum id and its alive rank.

    Read from miles' own state at the time of the update: ``get_parallel_state().indep_dp`` is the
    group miles builds from the cell's ``IndepDPInfo`` at init and rebuilds at every
    ``reconfigure_indep_dp`` (its ``rank`` is the alive rank, its ``debug_info["quorum"]`` the
    quorum id). None when miles does not say (FSDP, a miles without it): the cell then never
    claims again once fenced.
    """
    try:
        group = parallel_state().indep_dp
        quorum, rank = group.debug_info.get("quorum"), group.rank
        job = runtime_context().get_job_id()
    except Exception as exc:  # miles' state is not what this commit has: no standing, and it is said
        log.warning(
            "miles' indep-DP state could not be read; this cell will not claim again once fenced",
            extra={"error": repr(exc)},
        )
        return None
    if type(quorum) is not int or type(rank) is not int or quorum < 0 or rank < 0 or not job:
        log.warning(
            "miles' indep-DP state has no quorum id or alive rank; this cell will not claim again once fenced",
            extra={"quorum": repr(quorum), "rank": repr(rank), "job": repr(job)},
        )
        return None
    return ClaimStanding(scope=f"ray-job:{job}", term=quorum, rank=rank)


_INSTALLER: Final = Installer(MILES, MilesTrainer, MilesSettings, _runtime)


def installed() -> MilesTrainer | None:
    """The process' installed integration, or None."""
    return _INSTALLER.installed()


def install(args: Any) -> MilesTrainer:
    """miles' ``--custom-megatron-init-path`` entry point: put weightbus in charge of every Megatron updater.

    Call once per training actor (miles does); a second call in the same process returns the first
    install. Rank 0 connects to the bus here, so an unreachable bus fails the actor's init.

    Args:
        args: miles' argument namespace (settings: ``weightbus.integrations.miles.config``).

    Returns:
        The installed integration.

    Raises:
        InstallError: a class, method, signature or module global the patches rely on is missing or
            different (nothing was patched).
        ValueError: no policy, or a setting that is not valid.
        BusConnectError: rank 0 could not reach NATS within the connect timeout (nothing was patched).
    """
    return _INSTALLER.install(args, MEGATRON_TARGETS)


def install_fsdp(args: Any = None) -> None:
    """The FSDP equivalent of ``install``, for a ``sitecustomize`` or launcher (FSDP actors have no init hook).

    ``import weightbus.integrations.miles as wb; wb.install_fsdp()`` patches miles' FSDP updater now
    if its module is imported, else right after it is (an import hook; the import raises
    ``InstallError`` if it does not fit). Settings come from the environment (``args`` None) or
    ``args``; the bus is connected by rank 0's first update, not at import.

    Raises:
        InstallError, ValueError: as ``install``, when the module is already imported.
    """
    MilesSettings.from_args(args)  # a missing policy fails here, in the launcher, not in the actor
    _INSTALLER.install_on_import(_FSDP, lambda: _INSTALLER.install(args, FSDP_TARGETS, connect=False))


def uninstall() -> None:
    """Restore every patched method, remove the FSDP import hook, and close the bus (tests, notebooks)."""
    _INSTALLER.uninstall()
