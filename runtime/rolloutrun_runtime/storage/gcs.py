"""gs:// backend on google-cloud-storage: the library's retries, a create-only commit.

Why the pieces:

* ``google.cloud.storage`` is imported only here and only when a gs:// storage is used, so
  the file:// path and the operator image need no Google libraries.
* The client comes from the environment: Application Default Credentials in production
  (``GOOGLE_APPLICATION_CREDENTIALS`` pointing at a mounted Secret, or workload identity);
  with ``STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT`` set, google-cloud-storage talks to
  that emulator with anonymous credentials. No project is needed for object operations.
* Retries are the library's own, request by request (:func:`request_retry`): each JSON
  call, multipart upload and *chunk* of a resumable upload gets the
  :class:`~.retry.RetryPolicy`'s attempts for 408/429/5xx/connection errors. A 5xx on chunk
  50 of a checkpoint re-sends chunk 50 to the same upload session (the server keeps the
  committed bytes), never the object from byte 0. Reads, lists, existence checks and deletes
  are idempotent; create-only writes go through the library's conditional policy
  (``ConditionalRetryPolicy``: retried because ``ifGenerationMatch`` is set); plain
  overwrites are retried too, as our overwrites are idempotent by construction (the same
  bytes to the same key under an uncommitted entry, one writer fenced by the trainer lease).
* Objects over 8 MiB go through a chunked resumable upload; smaller ones are one multipart
  request. Create-only writes (``ifGenerationMatch=0``) are always the latter: the marker or
  manifest written that way is the commit point, and it is atomic on GCS and the emulator.
* A create-only write that hit a transient error may have committed before the error
  reached us; its retry then sees 412. Each create-only write carries a random writer token
  in its metadata, so a 412 can tell "I already won" from "someone else won".
* ``write_many`` (a snapshot's files) uploads in parallel, at most ``parallel_uploads`` at
  once, and returns only when every upload has ended, so nothing is still in flight when
  the publisher's lease check and commit marker follow.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from .errors import (
    BucketNotFoundError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
)
from .keys import (
    TMP_PREFIX,
    check_create_only_size,
    entries_of,
    normalize_prefix,
    validate_key,
)
from .retry import AttemptBudget, RetryPolicy

log = logging.getLogger(__name__)

T = TypeVar("T")

UPLOAD_CHUNK_BYTES = 8 * 1024 * 1024
"""Resumable upload chunk (a multiple of 256 KiB); objects above 8 MiB use resumable."""

WRITER_TOKEN_KEY = "rolloutrun-writer"
"""Custom metadata key holding a create-only write's random writer token."""

DISABLE_BUCKET_METADATA_ENV = "DISABLE_GCS_PYTHON_CLIENT_OTEL_BUCKET_METADATA"

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})

PARALLEL_UPLOADS = 8
"""Uploads of one ``write_many`` in flight at once (the client's HTTP pool holds 10)."""


def import_gcs() -> Any:
    """Import ``google.cloud.storage`` (lazily, on first gs:// use).

    google-api-core warns at import time when grpcio is installed without grpcio-status
    (ray pulls in grpcio); we use only the HTTP API, so that warning is noise and, under
    ``-W error``, fatal.

    We also switch off (unless the user set it) the library's telemetry-only background
    fetch of bucket metadata: it sends extra ``buckets.get`` requests from daemon threads,
    which object-only service accounts may not be allowed, and which race with our calls.
    """
    os.environ.setdefault(DISABLE_BUCKET_METADATA_ENV, "true")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*grpcio-status.*", category=ImportWarning)
        from google.cloud import storage

    return storage


def status_error(status: int, uri: str, detail: str) -> StorageError:
    """The storage error for an HTTP ``status`` on ``uri`` (a pure mapping)."""
    detail = " ".join(detail.split())[:300]
    if status == 404:
        return ObjectNotFoundError(uri, "no such object")
    if status in (401, 403):
        return StoragePermissionError(uri, f"permission denied, HTTP {status} ({detail})")
    if status == 412:
        return ObjectExistsError(uri, "object already exists (create-only precondition failed)")
    if status in TRANSIENT_STATUS:
        return TransientStorageError(uri, f"transient HTTP {status} ({detail})")
    return StorageError(uri, f"HTTP {status} ({detail})")


def translate_gcs_error(exc: BaseException, uri: str) -> StorageError | None:
    """Map a google-cloud-storage / transport exception to the storage hierarchy.

    Returns ``None`` for exceptions that are not storage failures (programming errors),
    which the caller re-raises unchanged.
    """
    import_gcs()
    import google.auth.exceptions as auth_exc
    import requests
    from google.api_core import exceptions as api_exc
    from google.cloud.storage import exceptions as media_exc

    if isinstance(exc, api_exc.GoogleAPICallError) and exc.code is not None:
        return status_error(int(exc.code), uri, exc.message or str(exc))
    if isinstance(exc, media_exc.InvalidResponse):
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", None)
        if status is not None:
            return status_error(int(status), uri, getattr(response, "text", "") or str(exc))
    if isinstance(exc, media_exc.DataCorruption):
        return TransientStorageError(uri, f"checksum mismatch in transfer ({exc})")
    if isinstance(exc, auth_exc.DefaultCredentialsError):
        return StoragePermissionError(
            uri,
            f"no Google credentials found ({exc}); set GOOGLE_APPLICATION_CREDENTIALS or, for an "
            "emulator, STORAGE_EMULATOR_HOST",
        )
    if isinstance(exc, auth_exc.RefreshError):
        return StoragePermissionError(uri, f"cannot refresh credentials ({exc})")
    if isinstance(
        exc,
        requests.exceptions.ConnectionError
        | requests.exceptions.Timeout
        | requests.exceptions.ChunkedEncodingError
        | auth_exc.TransportError
        | ConnectionError
        | TimeoutError,
    ):
        return TransientStorageError(uri, f"connection failed ({type(exc).__name__}: {exc})")
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether a library/transport exception is worth retrying (408/429/5xx, connection)."""
    return isinstance(translate_gcs_error(exc, ""), TransientStorageError)


@functools.cache
def _request_retry_class() -> Any:
    """``google.api_core.retry.Retry`` giving each wrapped request its own attempt budget.

    A plain ``Retry`` is deadline-bounded and shares nothing per request; the library wraps
    every request it sends (each chunk included) with ``retry(request)``, so overriding
    ``__call__`` gives each one ``policy.attempts`` tries. Built lazily: no Google import
    until a gs:// storage is used.
    """
    import_gcs()
    from google.api_core.retry import Retry

    class RequestRetry(Retry):
        def __init__(self, policy: RetryPolicy, what: str) -> None:
            super().__init__(
                predicate=is_transient,
                initial=policy.initial_delay,
                maximum=policy.max_delay,
                multiplier=policy.multiplier,
                timeout=None,
            )
            self.policy, self.what = policy, what

        def __call__(self, func: Callable[..., Any], on_error: Any = None) -> Any:
            budget = AttemptBudget(self.policy)

            def predicate(exc: Exception) -> bool:
                again = budget.allow(is_transient(exc))
                if again:
                    log.info(
                        "retrying %s (attempt %d of %d): %s",
                        self.what, budget.failures + 1, self.policy.attempts, exc,
                    )  # fmt: skip
                return again

            return Retry(
                predicate=predicate,
                initial=self.policy.initial_delay,
                maximum=self.policy.max_delay,
                multiplier=self.policy.multiplier,
                timeout=None,
            )(func, on_error=on_error)

    return RequestRetry


def request_retry(policy: RetryPolicy, what: str, *, conditional: bool = False) -> Any:
    """The library retry for one operation; ``conditional``: only with a precondition set."""
    retry = _request_retry_class()(policy, what)
    if not conditional:
        return retry
    from google.cloud.storage.retry import ConditionalRetryPolicy, is_generation_specified

    return ConditionalRetryPolicy(retry, is_generation_specified, ["query_params"])


class GcsStorage:
    """:class:`~.base.CheckpointStorage` over ``gs://bucket/prefix``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        retry: RetryPolicy | None = None,
        timeout: float = 60.0,
        parallel_uploads: int = PARALLEL_UPLOADS,
    ) -> None:
        if parallel_uploads < 1:
            raise ValueError(f"parallel_uploads must be >= 1, got {parallel_uploads}")
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self.base_uri = f"gs://{bucket}/{self.prefix}" if self.prefix else f"gs://{bucket}"
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        self.parallel_uploads = parallel_uploads
        self._client = client
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"GcsStorage({self.base_uri!r})"

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The ``google.cloud.storage.Client``, built from the environment on first use."""
        with self._lock:
            if self._client is None:
                gcs = import_gcs()
                with _translated(self.base_uri):
                    self._client = gcs.Client(project=None)
            return self._client

    def _object_name(self, key: str) -> str:
        validate_key(key, base_uri=self.base_uri)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri_for(self, key: str) -> str:
        return f"gs://{self.bucket_name}/{self._object_name(key)}"

    def _blob(self, key: str, *, upload: bool = False) -> Any:
        blob = self.client.bucket(self.bucket_name).blob(self._object_name(key))
        if upload:
            # Only for uploads: on a download, chunk_size would switch to ranged requests.
            blob.chunk_size = UPLOAD_CHUNK_BYTES
        return blob

    def _call(self, uri: str, what: str, op: Callable[[Any], T], *, conditional: bool = False) -> T:
        """Run ``op(retry)`` (it passes ``retry`` to the library) with errors translated."""
        retry = request_retry(self.retry, f"{what} {uri}", conditional=conditional)
        with _translated(uri):
            return op(retry)

    def _bucket_missing(self) -> bool:
        """Whether the bucket is known not to exist (False when we may not ask)."""
        try:
            return not self._call(
                self.base_uri,
                "checking bucket",
                lambda retry: self.client.bucket(self.bucket_name).exists(
                    retry=retry, timeout=self.timeout
                ),
            )
        except StorageError:
            return False

    def _missing_bucket_error(self, uri: str) -> BucketNotFoundError:
        return BucketNotFoundError(uri, f"bucket {self.bucket_name!r} does not exist")

    def _upload_404(self, exc: ObjectNotFoundError) -> StorageError:
        """An upload that got 404: the bucket is missing (or a resumable session expired)."""
        if self._bucket_missing():
            return self._missing_bucket_error(exc.uri)
        return StorageError(exc.uri, "HTTP 404 during upload (upload session expired?)")

    # -- writes -----------------------------------------------------------------------------

    def write_bytes(self, key: str, data: bytes, *, durable: bool = True) -> None:
        uri = self.uri_for(key)  # every completed upload is durable: ``durable`` changes nothing
        try:
            self._call(
                uri,
                "writing",
                lambda retry: self._blob(key, upload=True).upload_from_string(
                    bytes(data),
                    content_type="application/octet-stream",
                    retry=retry,
                    timeout=self.timeout,
                ),
            )
        except ObjectNotFoundError as exc:
            raise self._upload_404(exc) from exc

    def write_many(self, items: Mapping[str, bytes]) -> None:
        """Upload in parallel (bounded); return once all ended, raise the first error."""
        if len(items) <= 1 or self.parallel_uploads == 1:
            for key, data in items.items():
                self.write_bytes(key, data)
            return
        jobs = [functools.partial(self.write_bytes, key, data) for key, data in items.items()]
        _run_all(jobs, self.parallel_uploads)

    def upload_files(self, items: Mapping[str, Path]) -> None:
        """:meth:`upload_file` for several keys, in parallel like :meth:`write_many`."""
        jobs = [functools.partial(self.upload_file, key, path) for key, path in items.items()]
        _run_all(jobs, self.parallel_uploads)

    def write_bytes_if_absent(self, key: str, data: bytes) -> None:
        uri = self.uri_for(key)
        check_create_only_size(uri, len(data))
        token = uuid.uuid4().hex

        def op(retry: Any) -> None:
            blob = self._blob(key, upload=True)
            blob.metadata = {WRITER_TOKEN_KEY: token}
            blob.upload_from_string(
                bytes(data),
                content_type="application/octet-stream",
                if_generation_match=0,
                retry=retry,
                timeout=self.timeout,
            )

        try:
            self._call(uri, "creating", op, conditional=True)
        except ObjectExistsError:
            # The library may have retried after a lost response: only our token says won.
            if self._written_by(key, token):
                log.info("create-only write of %s had succeeded before a retry", uri)
                return
            raise
        except ObjectNotFoundError as exc:
            raise self._upload_404(exc) from exc

    def _written_by(self, key: str, token: str) -> bool:
        uri = self.uri_for(key)
        blob = self._call(
            uri,
            "checking writer of",
            lambda retry: self.client.bucket(self.bucket_name).get_blob(
                self._object_name(key), retry=retry, timeout=self.timeout
            ),
        )
        return blob is not None and (blob.metadata or {}).get(WRITER_TOKEN_KEY) == token

    def upload_file(self, key: str, local_path: Path) -> None:
        uri = self.uri_for(key)
        local_path = Path(local_path)
        if not local_path.is_file():
            raise StorageError(str(local_path), "source file does not exist or is not a file")
        try:
            self._call(
                uri,
                "uploading",
                lambda retry: self._blob(key, upload=True).upload_from_filename(
                    str(local_path),
                    content_type="application/octet-stream",
                    retry=retry,
                    timeout=self.timeout,
                ),
            )
        except ObjectNotFoundError as exc:
            raise self._upload_404(exc) from exc

    # -- reads ------------------------------------------------------------------------------

    def read_bytes(self, key: str) -> bytes:
        uri = self.uri_for(key)
        try:
            data: bytes = self._call(
                uri,
                "reading",
                lambda retry: self._blob(key).download_as_bytes(retry=retry, timeout=self.timeout),
            )
        except ObjectNotFoundError as exc:
            if self._bucket_missing():
                raise self._missing_bucket_error(exc.uri) from exc
            raise
        return data

    def download_file(self, key: str, local_path: Path) -> None:
        uri = self.uri_for(key)
        local_path = Path(local_path)
        tmp = local_path.parent / f"{TMP_PREFIX}{local_path.name}.{uuid.uuid4().hex}"
        try:
            self._call(
                uri,
                "downloading",
                lambda retry: self._blob(key).download_to_filename(
                    str(tmp), retry=retry, timeout=self.timeout
                ),
            )
            os.replace(tmp, local_path)
        except ObjectNotFoundError as exc:
            if self._bucket_missing():
                raise self._missing_bucket_error(exc.uri) from exc
            raise
        except OSError as exc:
            raise StorageError(str(local_path), f"cannot write local file: {exc}") from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def exists(self, key: str) -> bool:
        uri = self.uri_for(key)
        found: bool = self._call(
            uri,
            "checking",
            lambda retry: self._blob(key).exists(retry=retry, timeout=self.timeout),
        )
        return found

    def list(self, prefix: str = "") -> list[str]:
        return [key for key, _ in self._listed(prefix)]

    def list_entries(self, prefix: str, marker_name: str) -> dict[str, bool]:
        """One listing of ``prefix`` (every object below it: the markers come with it)."""
        return entries_of(
            self.list(prefix), normalize_prefix(prefix, base_uri=self.base_uri), marker_name
        )

    def modified_times(self, prefix: str = "") -> dict[str, float]:
        """One listing: each blob's ``updated`` (server time) comes with it."""
        return {key: blob.updated.timestamp() for key, blob in self._listed(prefix)}

    def _listed(self, prefix: str) -> Sequence[tuple[str, Any]]:
        """``(key, blob)`` under ``prefix``, sorted by key (one paged listing)."""
        prefix = normalize_prefix(prefix, base_uri=self.base_uri)
        full = "/".join(p for p in (self.prefix, prefix) if p)
        list_prefix = full + "/" if full else ""
        strip = len(self.prefix) + 1 if self.prefix else 0
        uri = f"gs://{self.bucket_name}/{list_prefix}"

        def op(retry: Any) -> list[tuple[str, Any]]:
            blobs = self.client.list_blobs(
                self.bucket_name, prefix=list_prefix, retry=retry, timeout=self.timeout
            )
            return [(blob.name[strip:], blob) for blob in blobs]

        try:
            listed: list[tuple[str, Any]] = self._call(uri, "listing", op)
        except ObjectNotFoundError as exc:
            raise self._missing_bucket_error(uri) from exc
        return sorted(listed, key=lambda item: item[0])

    # -- deletes ----------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        uri = self.uri_for(key)
        try:
            self._call(
                uri,
                "deleting",
                lambda retry: self._blob(key).delete(retry=retry, timeout=self.timeout),
            )
        except ObjectNotFoundError as exc:
            if self._bucket_missing():
                raise self._missing_bucket_error(exc.uri) from exc

    def delete_prefix(self, prefix: str, *, durable: bool = True) -> int:
        keys = self.list(prefix)  # every completed delete is durable: ``durable`` changes nothing
        for key in keys:
            self.delete(key)
        log.debug("deleted %d objects under %s/%s", len(keys), self.base_uri, prefix)
        return len(keys)


def _run_all(jobs: Sequence[Callable[[], None]], workers: int) -> None:
    """Run ``jobs`` on at most ``workers`` threads; wait for all, then raise the first error."""
    if not jobs:
        return
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="gcs") as pool:
        futures = [pool.submit(job) for job in jobs]
    errors = [error for future in futures if (error := future.exception()) is not None]
    if errors:
        raise errors[0]


@contextlib.contextmanager
def _translated(uri: str) -> Iterator[None]:
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        translated = translate_gcs_error(exc, uri)
        if translated is None:
            raise
        raise translated from exc
