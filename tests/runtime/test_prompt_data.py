"""A user's prompt set: JSONL or Parquet from file:// or gs:// (the emulator), mapped by field.

Each bad file fails with its URI, the row and the field named; rows reach ``/run`` as the
wire contract's ``PromptPayload``; the dataloader over the set keeps its cursor rules.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.algorithms.gym_client import run_request_body
from rolloutrun_runtime.contract.run_config import (
    UNRESTORABLE_EXIT_CODE,
    ConfigError,
    DatasetConfig,
    parse_run_config,
)
from rolloutrun_runtime.experience.rollout_recovery import EnvironmentEpisode
from rolloutrun_runtime.prompt_data import PromptDataError, locate, read_prompt_set
from rolloutrun_runtime.storage import CheckpointStorage
from tests.support.gcs_emulator import FakeGcs

ROWS = [
    {"question": "7*4=", "product": 28, "a": 7, "tags": ["x"]},
    {"question": "3*3=", "product": 9, "a": 3, "tags": []},
]
MAPPING = {"promptField": "question", "answerField": "product", "metadataFields": ["a", "tags"]}


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def parquet(rows: list[dict[str, Any]]) -> bytes:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue()


def dataset(uri: str, **fields: Any) -> DatasetConfig:
    return DatasetConfig.model_validate({"uri": uri, **MAPPING, **fields})


@pytest.fixture
def emulator_env(fake_gcs: FakeGcs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.url)  # read_prompt_set's own client


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_rows_read_from_any_storage_uri_map_fields(
    storage: CheckpointStorage, emulator_env: None, kind: str
) -> None:
    data = jsonl(ROWS) if kind == "jsonl" else parquet(ROWS)
    storage.write_bytes(f"data/train.{kind}", data)
    prompts = read_prompt_set(dataset(storage.uri_for(f"data/train.{kind}")), "unused")
    assert len(prompts) == 2
    assert prompts.payload(0) == {
        "text": "7*4=",
        "answer": 28,
        "metadata": {"a": 7, "tags": ["x"]},
    }
    # A relative uri is a key under the run's storage.
    base = storage.uri_for(f"data/train.{kind}").removesuffix(f"/data/train.{kind}")
    relative = read_prompt_set(dataset(f"data/train.{kind}"), base)
    assert relative.payload(1) == prompts.payload(1)


def test_rows_reach_run_requests_as_the_wire_payload(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_bytes(jsonl(ROWS))
    prompts = read_prompt_set(dataset(f"file://{tmp_path}/p.jsonl"), "unused")
    body = run_request_body(
        EnvironmentEpisode("r0", 0), 1, "http://127.0.0.1:9/", {}, prompts.payload(1)
    )
    assert body["prompt"] == {"text": "3*3=", "answer": 9, "metadata": {"a": 3, "tags": []}}
    assert "prompt" not in run_request_body(
        EnvironmentEpisode("r0", 0), 1, "http://127.0.0.1:9/", {}
    )


@pytest.mark.parametrize(
    ("content", "fields", "message"),
    [
        (
            b'{"question": "1*1=", "product": 1, "a": 1, "tags": []}\n[1]\n',
            {},
            "row 2: expected a JSON object",
        ),
        (b'{"question": "1*1=", "product": 1}\n{"question": \n', {}, "row 2: not valid JSON"),
        (
            jsonl([{"q": "1*1="}]),
            {},
            "row 1: no field 'question' (task.dataset.promptField); it has q",
        ),
        (
            jsonl([{"question": 5, "product": 1}]),
            {},
            "row 1: field 'question' must be a non-empty string",
        ),
        (jsonl([{"question": "1=", "a": 1, "tags": []}]), {}, "row 1: no field 'product'"),
        (
            jsonl([{"question": "1=", "product": 1, "tags": []}]),
            {},
            "row 1: no field 'a' (task.dataset.metadataFields)",
        ),
        (
            b'{"question": "1=", "product": NaN, "a": 1, "tags": []}\n',
            {},
            "row 1: not valid JSON: NaN",
        ),
        (b"\n\n", {}, "holds no rows"),
        (b"\xff\xfe", {}, "not UTF-8"),
        (b"not parquet", {"format": "parquet"}, "Parquet"),
    ],
)
def test_a_bad_file_names_the_file_row_and_field(
    tmp_path: Path, content: bytes, fields: dict[str, Any], message: str
) -> None:
    (tmp_path / "bad.jsonl").write_bytes(content)
    uri = f"file://{tmp_path}/bad.jsonl"
    with pytest.raises(PromptDataError) as caught:
        read_prompt_set(dataset(uri, **fields), "unused")
    assert str(caught.value).startswith(uri)
    assert message in str(caught.value)


def test_missing_file_and_unknown_suffix_are_named(tmp_path: Path) -> None:
    with pytest.raises(PromptDataError, match=r"absent\.jsonl: cannot read the prompt file"):
        read_prompt_set(dataset(f"{tmp_path}/absent.jsonl"), "unused")
    with pytest.raises(
        PromptDataError, match=r"p\.csv: cannot tell the format.*task.dataset.format"
    ):
        read_prompt_set(dataset(f"{tmp_path}/p.csv"), "unused")


def test_locate_splits_directory_and_name() -> None:
    assert locate("gs://b-1/a/b/p.parquet", "x") == ("gs://b-1/a/b", "p.parquet")
    assert locate("gs://b-1/p.jsonl", "x") == ("gs://b-1", "p.jsonl")
    assert locate("file:///d/p.jsonl", "x") == ("file:///d", "p.jsonl")
    assert locate("/p.jsonl", "x") == ("file:///", "p.jsonl")
    assert locate("data/p.jsonl", "gs://b-1/run") == ("gs://b-1/run", "data/p.jsonl")


def test_a_dataset_needs_the_external_task() -> None:
    run = {"task": {"name": "arithmetic", "dataset": {"uri": "data/p.jsonl"}}}
    with pytest.raises(ConfigError, match=r"task\.dataset needs task\.name: external"):
        parse_run_config(run)
    run["task"]["name"] = "external"  # type: ignore[index]
    assert parse_run_config(run).task.dataset is not None
    turn = {"task": {"name": "external"}, "checkpointing": {"targetLevel": "turn"}}
    assert parse_run_config(turn).checkpointing.target_level.value == "turn"


def test_the_trainer_entry_point_names_a_bad_prompt_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rolloutrun_runtime import trainer

    config = tmp_path / "run.yaml"
    absent = tmp_path / "absent.jsonl"
    config.write_text(
        json.dumps(
            {
                "logDir": str(tmp_path / "run"),
                "task": {"name": "external", "dataset": {"uri": str(absent)}},
                "gym": {"replicas": 1, "endpoints": ["http://127.0.0.1:9"]},
                "workers": {"backend": "inprocess"},
            }
        )
    )
    code = trainer.main(argparse.Namespace(config=str(config), log_dir=None))
    assert code == UNRESTORABLE_EXIT_CODE  # a restart reads the same file: no restart loop
    assert f"{absent}: cannot read the prompt file" in capsys.readouterr().err
