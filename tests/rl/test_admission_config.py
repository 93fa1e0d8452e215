"""``weightbus rollout``'s admission settings: bounded by default, the flags map onto the config, bad values refused."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from weightbus.cli import app
from weightbus.errors import ConfigError
from weightbus.rl.config import RolloutConfig, make_config


def test_bounded_is_the_default_and_the_fields_decode() -> None:
    base = make_config(RolloutConfig, router_url="http://r", policy="p")
    assert (base.admission, base.cap, base.admission_shared) == ("bounded", None, False)
    capped = make_config(RolloutConfig, base, admission="cap", cap=3, admission_shared=True)
    assert (capped.admission, capped.cap, capped.admission_shared) == ("cap", 3, True)
    with pytest.raises(ConfigError, match="admission"):
        make_config(RolloutConfig, base, admission="sometimes")
    with pytest.raises(ConfigError, match="cap"):
        make_config(RolloutConfig, base, cap=0)


def test_the_rollout_command_offers_the_flags() -> None:
    result = CliRunner().invoke(app, ["rollout", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in ("--admission", "--admission-cap", "--admission-shared"):
        assert flag in result.output
