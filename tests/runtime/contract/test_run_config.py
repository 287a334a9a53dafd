"""RunConfig: defaults, aliases, derived values and clear errors."""

from __future__ import annotations

import pytest

from rolloutrun_runtime.contract.run_config import (
    ConfigError,
    RunConfig,
    TargetLevel,
    load_run_config,
    parse_run_config,
)


def test_defaults_validate_and_round_trip_through_camel_case():
    config = RunConfig()
    data = config.to_yaml_dict()
    assert "groupSize" in data["grpo"] and "group_size" not in data["grpo"]
    assert RunConfig.model_validate(data) == config


def test_error_names_the_field_path():
    with pytest.raises(ConfigError) as caught:
        parse_run_config({"grpo": {"groupSize": 1}, "task": {"bogus": 1}}, source="x.yaml")
    message = str(caught.value)
    assert "grpo.groupSize" in message and "task.bogus" in message and "x.yaml" in message


def test_storage_uri_defaults_under_the_log_dir(tmp_path):
    config = parse_run_config({"logDir": str(tmp_path)})
    assert config.resolved_storage_uri() == f"file://{tmp_path}/checkpoints"
    assert parse_run_config(
        {"checkpointing": {"storageUri": "/data/x"}}
    ).resolved_storage_uri() == ("file:///data/x")


def test_ledger_is_forced_on_by_rollout_recovery():
    config = parse_run_config({"rollout": {"ledgerDispatch": False}})
    assert config.checkpointing.target_level is TargetLevel.SIBLING and config.uses_ledger
    off = parse_run_config(
        {"rollout": {"ledgerDispatch": False}, "checkpointing": {"targetLevel": "none"}}
    )
    assert not off.uses_ledger


def test_fingerprint_ignores_excluded_keys_only():
    a = parse_run_config({"logDir": "a"})
    b = parse_run_config({"logDir": "b"})
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint(frozenset({"logDir"})) == b.fingerprint(frozenset({"logDir"}))


def test_the_settings_a_rolloutrun_states_are_the_config_less_what_the_operator_derives():
    from rolloutrun_runtime.contract.run_config import RunSettings

    full = parse_run_config(
        {
            "gym": {"replicas": 1, "endpoints": ["http://127.0.0.2:8000"]},
            "checkpointing": {"storageUri": "gs://bucket/p", "resumeHint": "gs://b/m.json"},
        }
    )
    settings = full.settings_yaml_dict()
    assert "endpoints" not in settings["gym"] and "replicas" not in settings["gym"]
    assert not {"storageUri", "resumeHint"} & set(settings["checkpointing"])
    assert RunSettings.model_validate(settings).to_yaml_dict() == settings
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        RunSettings.model_validate(full.to_yaml_dict())


def test_endpoints_must_match_replicas():
    with pytest.raises(ConfigError, match=r"gym\.endpoints lists 1 URLs"):
        parse_run_config({"gym": {"replicas": 2, "endpoints": ["http://127.0.0.2:8000"]}})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- a\n- b\n", "expected a mapping"),
        ("kind: RolloutRun\nspec: 3\n", "spec.run"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_bad_files_get_clear_errors(tmp_path, text, expected):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_run_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_run_config(tmp_path / "nope.yaml")
