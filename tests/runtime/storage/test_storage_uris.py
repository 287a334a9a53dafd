"""URI dispatch, bucket and key rules, and the retry policy: pure units, no I/O servers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rolloutrun_runtime.storage import (
    RetryPolicy,
    UnsupportedStorageError,
    open_storage,
    parse_gs_uri,
)
from rolloutrun_runtime.storage.gcs import GcsStorage, status_error
from rolloutrun_runtime.storage.keys import key_problem
from rolloutrun_runtime.storage.local import LocalStorage
from rolloutrun_runtime.storage.retry import AttemptBudget, backoff_cap

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("uri", "root"),
    [
        ("file:///data/ckpt", "/data/ckpt"),
        ("file:///data/ckpt/", "/data/ckpt"),
        ("file://localhost/data/ckpt", "/data/ckpt"),
        ("/data/ckpt", "/data/ckpt"),
        ("/data//ckpt/", "/data/ckpt"),
    ],
)
def test_file_uris(uri: str, root: str) -> None:
    storage = open_storage(uri)
    assert isinstance(storage, LocalStorage)
    assert storage.root == Path(root)
    assert storage.base_uri == f"file://{root}"


@pytest.mark.parametrize(
    ("uri", "base", "prefix"),
    [
        ("gs://my-bucket", "gs://my-bucket", ""),
        ("gs://my-bucket/", "gs://my-bucket", ""),
        ("gs://my-bucket/runs/r1/", "gs://my-bucket/runs/r1", "runs/r1"),
    ],
)
def test_gs_uris(uri: str, base: str, prefix: str) -> None:
    storage = open_storage(uri)  # nothing contacted, no client built yet
    assert isinstance(storage, GcsStorage)
    assert storage.base_uri == base
    assert storage.prefix == prefix
    assert storage.uri_for("a/b") == f"{base}/a/b"


@pytest.mark.parametrize(
    ("uri", "reason"),
    [
        ("s3://bucket/x", "unknown storage scheme 's3'"),
        ("hdfs:///x", "unknown storage scheme 'hdfs'"),
        ("relative/dir", "relative paths are not accepted"),
        ("", "non-empty"),
        ("file://host/x", "must not name a host"),
        ("file:relative", "absolute path"),
        ("gs://", "names no bucket"),
        ("gs:///prefix", "names no bucket"),
        ("gs://Upper/x", "may contain only"),
        ("gs://ab/x", "3 to 222"),
        ("gs://-bucket/x", "start and end"),
        ("gs://bucket/a/../b", "bad object prefix"),
        ("gs://bucket/x?y=1", "query"),
    ],
)
def test_bad_uris_name_the_uri_and_cause(uri: str, reason: str) -> None:
    with pytest.raises(UnsupportedStorageError) as info:
        open_storage(uri)
    assert reason in str(info.value)
    assert (uri or "''") in str(info.value)
    assert isinstance(info.value, ValueError)


def test_parse_gs_uri() -> None:
    assert parse_gs_uri("gs://b-1.x/p/q") == ("b-1.x", "p/q")


@pytest.mark.parametrize(
    ("key", "ok"),
    [
        ("a", True),
        ("a/b/c.bin", True),
        ("step_10/COMMITTED", True),
        (".hidden/x", True),
        ("a b/ü", True),
        ("", False),
        ("/a", False),
        ("a//b", False),
        ("a/", False),
        ("..", False),
        ("a/./b", False),
        ("a\x00b", False),
        ("x/.rr-tmp-y", False),
        ("k" * 901, False),
    ],
)
def test_key_rules(key: str, ok: bool) -> None:
    assert (key_problem(key) is None) is ok


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (404, "ObjectNotFoundError"),
        (401, "StoragePermissionError"),
        (403, "StoragePermissionError"),
        (412, "ObjectExistsError"),
        (408, "TransientStorageError"),
        (429, "TransientStorageError"),
        (500, "TransientStorageError"),
        (503, "TransientStorageError"),
        (400, "StorageError"),
    ],
)
def test_status_mapping(status: int, kind: str) -> None:
    err = status_error(status, "gs://b/k", "detail")
    assert type(err).__name__ == kind
    assert str(err).startswith("gs://b/k: ")


def test_backoff_grows_and_is_capped() -> None:
    policy = RetryPolicy(attempts=10, initial_delay=0.5, max_delay=3.0, multiplier=2.0)
    assert [backoff_cap(policy, i) for i in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_each_request_gets_the_policys_attempts_and_only_transient_failures_retry() -> None:
    budget = AttemptBudget(RetryPolicy(attempts=3))
    assert [budget.allow(True) for _ in range(3)] == [True, True, False]
    assert AttemptBudget(RetryPolicy(attempts=3)).allow(False) is False
    assert AttemptBudget(RetryPolicy(attempts=1)).allow(True) is False


@pytest.mark.parametrize("bad", [{"attempts": 0}, {"initial_delay": -1}, {"multiplier": 0.5}])
def test_retry_policy_validates(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**bad)  # type: ignore[arg-type]


def test_file_backend_never_imports_google(tmp_path: Path) -> None:
    """The operator image has no Google libraries: file:// must work without them."""
    code = (
        "import sys\n"
        "from rolloutrun_runtime.storage import open_storage, publish_entry\n"
        f"s = open_storage({str(tmp_path)!r})\n"
        "publish_entry(s, 'e', {'f': b'1'})\n"
        "s2 = open_storage('gs://bucket/x')\n"  # opening does not import either
        "bad = sorted(m for m in sys.modules if m.startswith('google'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(REPO / "runtime"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
