"""Each setting of ``rollout``, ``trainer``, ``engine`` and ``demo`` is declared once, as its config's field.

Before, each was declared twice, a flag and a field, and they drifted: ``temperature``, ``clip``, ``early_abort``
and four more had no flag (docs/rollout.md told of ``weightbus rollout --early-abort`` all the same), the demo took
``--in-flight 5000`` that its rollout child then refused, and a ``--config`` file's ``nats_url`` lost to a
``--context`` on the real commands. Now the flags are derived from the fields (``weightbus.cli.config_flags``):
one flag per field and one field per flag, the field's default and help, the public names that predate it kept.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.main import get_command
from typer.testing import CliRunner

from weightbus.cli import app
from weightbus.cli.config_flags import ConfigFlags, Flag, field_flags
from weightbus.cli.connection import CONNECTION_FLAGS
from weightbus.cli.demo import DEMO_FLAGS
from weightbus.cli.engine import ENGINE_FLAGS
from weightbus.cli.options import LOG_FLAGS
from weightbus.cli.rl import ROLLOUT_FLAGS, TRAINER_FLAGS
from weightbus.demo.config import DemoConfig
from weightbus.rl.config import RolloutConfig, TrainerConfig

runner = CliRunner()

#: Each command whose settings are a config, and its flags.
COMMANDS: dict[str, ConfigFlags[Any]] = {
    "rollout": ROLLOUT_FLAGS,
    "trainer": TRAINER_FLAGS,
    "engine": ENGINE_FLAGS,
    "demo": DEMO_FLAGS,
}
#: The fields that have no flag on purpose, and why.
NO_FLAG = {("demo", "policy"): "internal to the demo's own NATS; a --policy would read WEIGHTBUS_POLICY"}
#: The parameters that are the command's, not a setting of one run: the file, the connection, the logs, a secret,
#: the start-up wait, the output, the comparisons (each runs several configs).
NOT_SETTINGS = {
    "rollout": {"config_file", "router_wait", "quiet", "verbose"},
    "trainer": {"config_file", "quiet", "verbose"},
    "engine": {"config_file", "api_key"},
    "demo": {"compare_admission", "repeats", "compare_staleness", "verbose"},
}
_SHARED = {p.name for p in (*CONNECTION_FLAGS, *LOG_FLAGS)} | {"help"}

#: The flag names and short options of each command before its flags were derived: scripts use them.
PUBLIC_BEFORE = {
    "rollout": "--config --router --nats --server -s --policy --task --group-size --batch --in-flight "
    "--max-staleness --on-stale --admission --admission-cap --admission-shared --no-admission-shared --follow-lora "
    "--no-follow-lora --seed --router-wait --metrics-port --metrics-host --quiet -q --verbose -v",
    "trainer": "--config --router --run-dir --nats --server -s --policy --steps --batch --seed --lr --lora-rank "
    "--lora-prefix --trainer-id --metrics-port --metrics-host --quiet -q --verbose -v",
    "engine": "--config --port --host --model --seed --sampling-seed --weight-version --api-key --token-delay",
    "demo": "--steps --max-staleness --on-stale --seed --out --no-faults --failover-at --kill-nats-at "
    "--restart-rollout-at --restart-engine-at --lora-rank --admission --early-abort --no-early-abort "
    "--compare-admission --repeats --compare-staleness --verbose -v",
}


def _params(command: str) -> dict[str, Any]:
    click_command = get_command(app).commands[command]  # type: ignore[attr-defined]
    return {p.name: p for p in click_command.params}


def _opts(command: str) -> set[str]:
    return {opt for p in _params(command).values() for opt in (*p.opts, *p.secondary_opts)}


def _fields(kind: type[msgspec.Struct]) -> list[msgspec.structs.FieldInfo]:
    return list(msgspec.structs.fields(kind))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_field_has_exactly_one_flag_and_every_flag_a_field(command: str) -> None:
    flags = COMMANDS[command]
    params = _params(command)
    fields = {f.name for f in _fields(flags.kind)} - {field for cmd, field in NO_FLAG if cmd == command}
    by_field = [f.field for f in flags.flags]
    assert sorted(by_field) == sorted(fields), "a field without a flag, or a flag without a field"
    settings = set(params) - _SHARED - NOT_SETTINGS[command]
    assert settings == fields, (
        f"on the command but no field: {settings - fields}; a field not on it: {fields - settings}"
    )
    # No two flags share a name.
    names = [opt for p in params.values() for opt in (*p.opts, *p.secondary_opts)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_flag_names_and_short_options_that_scripts_use_still_work(command: str) -> None:
    missing = set(PUBLIC_BEFORE[command].split()) - _opts(command)
    assert not missing, missing


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_flag_defaults_to_its_field(command: str) -> None:
    """Absent, a flag leaves the field's default (or the file's value): typer's default is None, and the config
    parsed from no flag is the config's own defaults."""
    flags = COMMANDS[command]
    params = _params(command)
    for flag in flags.flags:
        assert params[flag.field].default is None, flag.field
    required = {f.name: "x" for f in _fields(flags.kind) if f.required}
    parsed = flags.parse(None, {flag.field: None for flag in flags.flags} | required)
    assert parsed == flags.kind(**required)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_lists_each_fields_help_and_default(command: str) -> None:
    flags = COMMANDS[command]
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "3000"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.replace("│", " ").split())
    hints = {f.name: f for f in _fields(flags.kind)}
    for flag in flags.flags:
        meta = _description(flags.kind, flag.field)
        assert " ".join(meta.replace("``", "").split()) in text, flag.field
        default = hints[flag.field].default
        if isinstance(default, bool):
            assert f"(default: {flag.flag if default else '--no-' + flag.flag[2:]})" in flag.help
        elif default is msgspec.NODEFAULT:
            assert "(required)" in flag.help
        elif default is not None:
            assert f"(default: {default})" in flag.help, flag.field
        assert flag.help in text, flag.field


def _description(kind: type[msgspec.Struct], field: str) -> str:
    """The field's description, as msgspec itself reads it (its JSON schema)."""
    (_, components) = msgspec.json.schema_components([kind])
    description: str = components[kind.__name__]["properties"][field]["description"]
    return description


def test_a_field_without_a_description_or_a_flag_type_is_refused_at_once() -> None:
    class NoHelp(msgspec.Struct, kw_only=True):
        steps: int = 1

    with pytest.raises(TypeError, match="description"):
        field_flags(NoHelp, {})
    with pytest.raises(TypeError, match="no field"):
        field_flags(RolloutConfig, {"stpes": Flag()})


def test_the_demo_refuses_what_its_children_would() -> None:
    """A setting the demo hands to its rollout or trainer has that field's type and constraints (``steps`` needs
    two steps, so that the faults spread); before, ``--in-flight 5000`` passed the demo and killed its rollout."""
    children = {f.name: f.type for kind in (RolloutConfig, TrainerConfig) for f in _fields(kind)}
    shared = [f for f in _fields(DemoConfig) if f.name in children and f.name not in ("steps", "policy")]
    assert {f.name for f in shared} >= {"group_size", "in_flight", "cap", "batch", "max_staleness", "lr"}
    for field in shared:
        assert _constraints(field.type) == _constraints(children[field.name]), field.name
    result = runner.invoke(app, ["demo", "--in-flight", "5000"])
    assert result.exit_code == 2 and "--in-flight" in result.output and "<= 1024" in result.output, result.output


def _constraints(hint: Any) -> Any:
    """The JSON schema of a type, without its description (which each config words for its own command)."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "description"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return strip(msgspec.json.schema(hint))


# --- the parsed config reaches the process (run_rollout replaced by a probe: nothing starts) ---------------


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    import weightbus.rl.rollout

    seen: dict[str, Any] = {}

    async def probe(config: RolloutConfig, **kwargs: Any) -> None:
        seen["config"], seen["kwargs"] = config, kwargs

    monkeypatch.setattr(weightbus.rl.rollout, "run_rollout", probe)
    yield seen


_CLEAN = {"WEIGHTBUS_NATS": None, "NATS_URL": None, "WEIGHTBUS_POLICY": None, "NATS_CONTEXT": None}


def test_every_rollout_setting_has_a_flag_that_reaches_the_process(seen: dict[str, Any]) -> None:
    args = ["rollout", "--router", "http://r:1", "-p", "p", "--temperature", "0.5", "--no-early-abort"]
    args += ["--no-freeze-heap", "--consumer", "c1", "--admission-shared", "--admission-lease-s", "20"]
    result = runner.invoke(app, [*args, "--router-wait", "3", "-q"], env=_CLEAN)
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.temperature, config.early_abort, config.freeze_heap, config.consumer) == (0.5, False, False, "c1")
    assert (config.admission_shared, config.admission_lease_s, config.policy) == (True, 20.0, "p")
    assert seen["kwargs"]["router_wait_s"] == 3.0


def test_a_flag_given_overrides_the_file_and_the_rest_comes_from_it(tmp_path: Path, seen: dict[str, Any]) -> None:
    path = tmp_path / "rollout.json"
    path.write_text(json.dumps({"router_url": "http://r:1", "policy": "p", "seed": 7, "group_size": 4}))
    result = runner.invoke(app, ["rollout", "--config", str(path), "--seed", "9", "-q"], env=_CLEAN)
    assert result.exit_code == 0, result.output
    assert (seen["config"].seed, seen["config"].group_size) == (9, 4)


def test_a_config_files_nats_url_beats_the_context(tmp_path: Path, seen: dict[str, Any]) -> None:
    """The real command's ``--config`` parameter: before, the context's url replaced the file's."""
    context = tmp_path / "nats" / "context" / "c.json"
    context.parent.mkdir(parents=True)
    context.write_text(json.dumps({"url": "nats://ctx.invalid:1"}))
    path = tmp_path / "rollout.json"
    path.write_text(json.dumps({"router_url": "http://r:1", "policy": "p", "nats_url": "nats://file.invalid:1"}))
    env = {**_CLEAN, "XDG_CONFIG_HOME": str(tmp_path)}
    result = runner.invoke(app, ["rollout", "--config", str(path), "--context", "c", "-q"], env=env)
    assert result.exit_code == 0, result.output
    assert seen["config"].nats_url == "nats://file.invalid:1"
    result = runner.invoke(app, ["rollout", "--router", "http://r:1", "-p", "p", "--context", "c", "-q"], env=env)
    assert result.exit_code == 0, result.output
    assert seen["config"].nats_url == "nats://ctx.invalid:1"  # without a file, the context fills the url


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["demo", "--on-stale", "sometimes"], "--on-stale must be recycle or drop"),
        (["engine", "--model", "gpt"], "--model must be hash, torch or policy"),
        (["rollout", "--router", "r", "-p", "p", "--temperature", "0"], "--temperature"),
        (["demo", "--steps", "1"], ">= 2"),
    ],
)
def test_a_bad_value_is_one_error_line_naming_its_flag(args: list[str], needle: str) -> None:
    result = runner.invoke(app, args, env=_CLEAN)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert needle in lines[0] and "$." not in lines[0], lines[0]


def test_the_docs_name_only_flags_that_exist() -> None:
    """Every ``weightbus <command> --flag`` the docs spell, for these commands, is a flag of that command."""
    root = Path(__file__).parents[2]
    docs = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    command = re.compile(r"weightbus (rollout|trainer|engine|demo)\b([^`\n]*)")
    checked = 0
    for doc in docs:
        for match in command.finditer(doc.read_text()):
            for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", match.group(2)):
                assert flag in _opts(match.group(1)) | {"--help"}, (doc.name, match.group(0))
                checked += 1
    assert checked > 10  # the pattern finds the docs' commands
