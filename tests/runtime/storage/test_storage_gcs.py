"""gs:// specifics against the real fake-gcs-server: retries through a fault-injecting HTTP
proxy, the ambiguous create-only retry, permissions, missing buckets, resumable uploads."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.storage import (
    BucketNotFoundError,
    CheckpointStorage,
    ObjectExistsError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
    list_committed,
    open_storage,
    publish_entry,
)
from rolloutrun_runtime.storage.gcs import WRITER_TOKEN_KEY
from tests.support.crash_publisher import check_committed_whole, kill_after_commits
from tests.support.gcs_emulator import FakeGcs, FaultProxy, free_port
from tests.support.storage_params import BUCKET, FAST_RETRY


@pytest.fixture
def proxy(fake_gcs: FakeGcs) -> Iterator[FaultProxy]:
    with FaultProxy(fake_gcs.url) as p:
        yield p


@pytest.fixture
def proxied(fake_gcs: FakeGcs, proxy: FaultProxy) -> CheckpointStorage:
    """A gs:// storage whose every request goes through ``proxy``."""
    return open_storage(
        f"gs://{BUCKET}/p-{uuid.uuid4().hex[:12]}",
        client=fake_gcs.client(proxy.url),
        retry=FAST_RETRY,
    )


def _statuses(proxy: FaultProxy) -> list[int]:
    return [status for _method, _path, status in proxy.requests]


OPERATIONS: dict[str, Callable[[CheckpointStorage, Path], object]] = {
    "write_bytes": lambda s, _: s.write_bytes("k", b"v"),
    "write_bytes_if_absent": lambda s, _: s.write_bytes_if_absent("new", b"v"),
    "read_bytes": lambda s, _: s.read_bytes("k"),
    "exists": lambda s, _: s.exists("k"),
    "list": lambda s, _: s.list(),
    "delete": lambda s, _: s.delete("k"),
    "upload_file": lambda s, tmp: s.upload_file("up", tmp / "src"),
    "download_file": lambda s, tmp: s.download_file("k", tmp / "dst"),
}


@pytest.mark.parametrize("op", sorted(OPERATIONS))
def test_every_operation_retries_503(proxied: CheckpointStorage, proxy: FaultProxy,
                                     tmp_path: Path, op: str) -> None:  # fmt: skip
    proxied.write_bytes("k", b"v")
    (tmp_path / "src").write_bytes(b"src")
    proxy.requests.clear()
    proxy.fail_next(2, status=503)
    OPERATIONS[op](proxied, tmp_path)
    assert _statuses(proxy)[:2] == [503, 503]
    assert len(proxy.requests) >= 3


def test_429_is_retried_and_exhaustion_raises(proxied: CheckpointStorage,
                                              proxy: FaultProxy) -> None:  # fmt: skip
    proxy.fail_next(1, status=429)
    proxied.write_bytes("k", b"v")
    assert _statuses(proxy) == [429, 200]

    proxy.requests.clear()
    proxy.fail_next(FAST_RETRY.attempts + 2, status=503)
    with pytest.raises(TransientStorageError) as info:
        proxied.read_bytes("k")
    assert info.value.uri == proxied.uri_for("k")
    assert "503" in str(info.value)
    assert _statuses(proxy) == [503] * FAST_RETRY.attempts  # bounded
    cause = info.value.__cause__
    assert cause is not None and not isinstance(cause, StorageError)  # google's, chained

    proxy.fail_next(FAST_RETRY.attempts, status=502)
    with pytest.raises(TransientStorageError, match="HTTP 502") as info:
        proxied.write_bytes("k", b"v")
    cause = info.value.__cause__
    assert cause is not None and not isinstance(cause, StorageError)


def test_create_only_retry_after_a_lost_response_succeeds(proxied: CheckpointStorage,
                                                          proxy: FaultProxy) -> None:  # fmt: skip
    """The first attempt commits but its response is lost; the retry sees 412 and must
    recognise its own write by the writer token instead of reporting a lost race."""
    proxy.fail_after_forward(1, status=503)
    proxied.write_bytes_if_absent("m/COMMITTED", b"mine")
    assert _statuses(proxy)[:2] == [503, 412]
    assert proxied.read_bytes("m/COMMITTED") == b"mine"


def test_create_only_retry_still_loses_to_another_writer(
    proxied: CheckpointStorage, proxy: FaultProxy
) -> None:
    proxied.write_bytes_if_absent("m/COMMITTED", b"theirs")
    proxy.fail_next(1, status=503)
    with pytest.raises(ObjectExistsError, match="already exists"):
        proxied.write_bytes_if_absent("m/COMMITTED", b"mine")
    assert proxied.read_bytes("m/COMMITTED") == b"theirs"


def test_publication_survives_injected_failures(proxied: CheckpointStorage,
                                                proxy: FaultProxy) -> None:  # fmt: skip
    for n in range(3):
        proxy.fail_next(1)
        proxy.fail_after_forward(1)
        publish_entry(proxied, f"snaps/step_{n}", {"a": b"a" * 1000, "b": b"b"})
    assert list_committed(proxied, "snaps") == [f"snaps/step_{n}" for n in range(3)]


def test_permission_denied_is_not_retried(proxied: CheckpointStorage, proxy: FaultProxy,
                                          tmp_path: Path) -> None:  # fmt: skip
    (tmp_path / "src").write_bytes(b"src")
    proxy.deny(403)
    for op, call in OPERATIONS.items():
        proxy.requests.clear()
        with pytest.raises(StoragePermissionError, match="permission denied, HTTP 403") as info:
            call(proxied, tmp_path)
        assert info.value.uri.startswith(proxied.base_uri), op
        assert len(proxy.requests) <= 2, op  # one try (+ a bucket probe), no retries


def test_connection_refused_is_transient(fake_gcs: FakeGcs) -> None:
    dead = open_storage(
        f"gs://{BUCKET}/x", client=fake_gcs.client(f"http://127.0.0.1:{free_port()}"),
        retry=FAST_RETRY,
    )  # fmt: skip
    with pytest.raises(TransientStorageError, match="connection failed"):
        dead.write_bytes("k", b"v")


def test_large_upload_is_resumable_and_chunked(proxied: CheckpointStorage, proxy: FaultProxy,
                                               tmp_path: Path) -> None:  # fmt: skip
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(20 * 1024 * 1024))
    proxied.upload_file("big/weights.bin", src)
    uploads = [(m, p) for m, p, _ in proxy.requests if "/upload/" in p]
    assert any(m == "POST" and "uploadType=resumable" in p for m, p in uploads)
    assert sum(1 for m, _ in uploads if m == "PUT") == 3  # 8 + 8 + 4 MiB chunks
    dst = tmp_path / "back.bin"
    proxied.download_file("big/weights.bin", dst)
    assert dst.read_bytes() == src.read_bytes()

    proxy.requests.clear()
    proxied.write_bytes("big/bytes.bin", b"x" * (9 * 1024 * 1024))
    assert any("uploadType=resumable" in p for _, p, _ in proxy.requests)
    assert proxied.read_bytes("big/bytes.bin") == b"x" * (9 * 1024 * 1024)


def test_missing_bucket(gcs_client: Any, tmp_path: Path) -> None:
    storage = open_storage("gs://no-such-bucket/run", client=gcs_client, retry=FAST_RETRY)
    (tmp_path / "src").write_bytes(b"src")
    for op, call in OPERATIONS.items():
        if op == "exists":
            assert storage.exists("k") is False  # documented: no extra bucket probe
            continue
        with pytest.raises(BucketNotFoundError, match="bucket 'no-such-bucket' does not") as info:
            call(storage, tmp_path)
        assert info.value.uri.startswith("gs://no-such-bucket/run"), op


def test_prefixes_are_isolated(fake_gcs: FakeGcs, gcs_client: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    a = open_storage(f"gs://{BUCKET}/{tag}/a", client=gcs_client)
    ab = open_storage(f"gs://{BUCKET}/{tag}/a-b", client=gcs_client)
    parent = open_storage(f"gs://{BUCKET}/{tag}", client=gcs_client)
    a.write_bytes("x", b"1")
    ab.write_bytes("y", b"2")
    assert a.list() == ["x"]
    assert ab.list() == ["y"]
    assert parent.list() == ["a-b/y", "a/x"]
    assert a.delete_prefix("") == 1
    assert parent.list() == ["a-b/y"]


def test_emulator_from_environment(fake_gcs: FakeGcs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a client, the backend builds one from the environment: STORAGE_EMULATOR_HOST
    selects the emulator with anonymous credentials (how local runs and CI use it)."""
    for name, value in fake_gcs.env().items():
        monkeypatch.setenv(name, value)
    storage = open_storage(f"gs://{BUCKET}/env-{uuid.uuid4().hex[:8]}")
    publish_entry(storage, "e", {"f": b"1"})
    assert list_committed(storage, "") == ["e"]
    blob = storage.client.bucket(BUCKET).get_blob(storage.prefix + "/e/COMMITTED")  # type: ignore[attr-defined]
    assert WRITER_TOKEN_KEY in (blob.metadata or {})


def test_sigkill_during_gs_publication(fake_gcs: FakeGcs, gcs_client: Any) -> None:
    """A publisher process SIGKILLed mid-publication against the emulator leaves only
    complete committed entries."""
    uri = f"gs://{BUCKET}/crash-{uuid.uuid4().hex[:8]}"
    kill_after_commits(uri, 3, env=fake_gcs.env())
    assert len(check_committed_whole(open_storage(uri, client=gcs_client))) >= 3


def test_missing_credentials_is_a_permission_error(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:  # fmt: skip
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing-key.json"))
    storage = open_storage(f"gs://{BUCKET}/x", retry=FAST_RETRY)
    with pytest.raises(StoragePermissionError, match="GOOGLE_APPLICATION_CREDENTIALS"):
        storage.read_bytes("k")


def test_errors_are_storage_errors(proxied: CheckpointStorage, proxy: FaultProxy) -> None:
    proxy.deny(400)
    with pytest.raises(StorageError, match="HTTP 400") as info:
        proxied.write_bytes("k", b"v")
    assert type(info.value) is StorageError


CHUNK = 8 * 1024 * 1024


def _chunk_at(offset: int) -> Callable[[str, str, Any], bool]:
    """Picks the resumable-upload PUT carrying the chunk that starts at ``offset``."""
    return lambda method, _path, headers: (
        method == "PUT" and headers.get("Content-Range", "").startswith(f"bytes {offset}-")
    )


@pytest.mark.parametrize("status", [503, 0], ids=["http-503", "connection-dropped"])
def test_an_interrupted_large_upload_resumes_from_its_last_chunk(
    proxied: CheckpointStorage, proxy: FaultProxy, tmp_path: Path, status: int
) -> None:
    """Chunk 3 of 5 fails; the same upload session gets chunk 3 again and goes on: one
    session, every byte sent once plus the one chunk, never the object from byte 0."""
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(5 * CHUNK - 12345))
    proxy.fail_matching(_chunk_at(2 * CHUNK), status=status)
    proxied.upload_file("big/weights.bin", src)
    sessions = [p for m, p, _ in proxy.received if m == "POST" and "uploadType=resumable" in p]
    assert len(sessions) == 1
    chunks = [(p, n) for m, p, n in proxy.received if m == "PUT" and "/upload/" in p]
    assert [n for _, n in chunks] == [CHUNK, CHUNK, CHUNK, CHUNK, CHUNK, CHUNK - 12345]
    assert sum(n for _, n in chunks) == src.stat().st_size + CHUNK
    assert status in [s for _, _, s in proxy.requests]  # the fault did happen
    back = tmp_path / "back.bin"
    proxied.download_file("big/weights.bin", back)
    assert back.read_bytes() == src.read_bytes()


def test_a_publication_with_an_interrupted_chunk_commits_once_and_fences_a_second_writer(
    proxied: CheckpointStorage, proxy: FaultProxy, tmp_path: Path
) -> None:
    files: dict[str, bytes | Path] = {f"shard_{i}.bin": os.urandom(1024) for i in range(6)}
    big = tmp_path / "weights.bin"
    big.write_bytes(os.urandom(2 * CHUNK + 1))
    files["weights.bin"] = big
    proxy.fail_matching(_chunk_at(CHUNK), status=503)
    publish_entry(proxied, "snaps/step_1", files)
    assert list_committed(proxied, "snaps") == ["snaps/step_1"]
    # a second writer (another incarnation) finds the entry committed and changes nothing
    with pytest.raises(ObjectExistsError):
        publish_entry(proxied, "snaps/step_1", {"shard_0.bin": b"stale"})
    # and racing for the marker itself, its create-only write is refused, retried or not
    proxy.fail_next(1, status=503)
    with pytest.raises(ObjectExistsError, match="already exists"):
        proxied.write_bytes_if_absent("snaps/step_1/COMMITTED", b"stale")
    assert proxied.read_bytes("snaps/step_1/shard_0.bin") == files["shard_0.bin"]


def test_write_many_uploads_in_parallel_and_waits_for_all(
    fake_gcs: FakeGcs, proxy: FaultProxy
) -> None:
    storage = open_storage(
        f"gs://{BUCKET}/par-{uuid.uuid4().hex[:8]}", client=fake_gcs.client(proxy.url),
        retry=FAST_RETRY,
    )  # fmt: skip
    items = {f"k{i}": bytes([i]) * 100 for i in range(12)}
    storage.write_many(items)
    assert proxy.max_in_flight > 1
    assert all(storage.read_bytes(k) == v for k, v in items.items())

    posts = iter(range(100))
    proxy.fail_matching(lambda m, _p, _h: m == "POST" and next(posts) == 3, status=403)
    with pytest.raises(StoragePermissionError):
        storage.write_many({f"again/{k}": v for k, v in items.items()})
    # every other upload ended before write_many raised: eleven are there, whole
    assert len(storage.list("again")) == 11
