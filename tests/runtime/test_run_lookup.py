"""Where ``rolloutrun audit``/``trace`` find a run: a log directory, a storage URI, or a
RolloutRun's ``spec.storage`` (a ``file://`` one through its claim's volume)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolloutrun_runtime.run_lookup import RunLookupError, storage_from_run, target_from_argument


def _run(uri: str, claim: str | None = "demo-storage") -> dict[str, object]:
    return {"spec": {"storage": {"uri": uri, "volumeClaimName": claim}}}


def test_gs_storage_is_read_where_it_is(tmp_path: Path) -> None:
    target = storage_from_run(_run("gs://b/runs/demo", None), tmp_path, "RolloutRun ns/demo")
    assert target.storage_uri == "gs://b/runs/demo" and target.log_dir is None


def test_file_storage_is_read_on_its_claims_volume(tmp_path: Path) -> None:
    target = storage_from_run(_run("file:///data/demo"), tmp_path, "RolloutRun ns/demo")
    assert target.storage_uri == f"file://{tmp_path}"


def test_file_storage_out_of_reach_says_where_to_run_the_command() -> None:
    with pytest.raises(RunLookupError, match="run the command in a pod that mounts the claim"):
        storage_from_run(_run("file:///no/such/dir"), None, "RolloutRun ns/demo")
    with pytest.raises(RunLookupError, match=r"has no spec\.storage\.uri"):
        storage_from_run({"spec": {}}, None, "RolloutRun ns/demo")


def test_old_and_new_arguments(tmp_path: Path) -> None:
    old = target_from_argument(str(tmp_path))
    assert old.log_dir == tmp_path
    assert old.storage_uri == f"file://{tmp_path.resolve()}/checkpoints"
    assert target_from_argument("gs://b/p/").storage_uri == "gs://b/p"
