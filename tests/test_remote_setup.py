"""Object-store setup mistakes, against a real S3 server (moto): each says what to fix.

No credentials, a plain-HTTP endpoint without ``allow_http``, a missing bucket and a
duration given in seconds. Each case goes through the calls a user makes (the async
and blocking reads, and a record dataset at the URL). The boundary in
``aioloader/_formats/objstore_errors.py`` maps obstore's exception; no test here may
see one raw, and each checks that obstore's is the ``__cause__``.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("obstore")

from aioloader.datasets import RecordFileDataset
from aioloader.io import (
    BucketNotFoundError,
    NoCredentialsError,
    ObjectStore,
    ObjectStoreError,
    StoreSetupError,
    TransientStoreError,
)
from tests._remote_fixtures import S3Server, jpegs, s3

__all__ = ["jpegs", "s3"]  # fixtures, imported for pytest

NO_RETRY = {"retry_config": {"max_retries": 0}}


def _reads(store: ObjectStore, key: str) -> list[Callable[[], Any]]:
    """Every way a user reads ``key``: async and blocking, whole and ranged, and a HEAD."""
    return [
        lambda: asyncio.run(store.get(key)),
        lambda: asyncio.run(store.get_range(key, 0, 4)),
        lambda: store.get_sync(key),
        lambda: store.get_range_sync(key, 0, 4),
        lambda: store.size_sync(key),
    ]


def _from_obstore(err: BaseException) -> None:
    """``err`` is aioloader's (or a built-in) and obstore's own exception is its cause."""
    assert not type(err).__module__.startswith("obstore"), type(err)
    cause = err.__cause__
    assert cause is not None and cause is not err
    assert type(cause).__module__.startswith("obstore") or type(cause) is FileNotFoundError, type(cause)


def _without_credentials(s3: S3Server) -> dict[str, Any]:
    return {k: v for k, v in s3.options.items() if k not in ("access_key_id", "secret_access_key")}


class _Metadata(BaseHTTPRequestHandler):
    """A stand-in for 169.254.169.254 off EC2: every request gets 403, as in the bug report."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str]]

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_PUT(self) -> None:
        self.seen.append((self.command, self.path))
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")  # no kept-alive connection outlives the test
        self.end_headers()
        self.close_connection = True

    do_GET = do_PUT


@pytest.fixture
def metadata_403() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    seen: list[tuple[str, str]] = []
    handler = type("Handler", (_Metadata,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = False  # server_close() joins the request threads
    thread = threading.Thread(target=server.serve_forever, name="metadata-403")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def no_aws_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No AWS credentials anywhere: no AWS_* variables, an empty home and AWS config files."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / ".aws" / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / ".aws" / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # for other AWS libraries; obstore ignores it
    return home


@pytest.mark.parametrize("metadata", ["answers 403", "refuses connections"])
def test_no_credentials_says_where_it_looked(
    metadata: str,
    s3: S3Server,
    no_aws_environment: Path,
    metadata_403: tuple[str, list[tuple[str, str]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # obstore asks the EC2 metadata service last. It is pointed at loopback here, so no
    # request leaves this machine: a server answering 403, or a port nobody listens on.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        endpoint, seen = metadata_403
        if metadata == "refuses connections":
            endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        monkeypatch.setenv("AWS_METADATA_ENDPOINT", endpoint)
        store = ObjectStore(s3.url("jpegs"), **_without_credentials(s3), **NO_RETRY)
        errors = []
        for read in _reads(store, "000.jpg"):
            with pytest.raises(NoCredentialsError) as info:
                read()
            errors.append(info.value)
        with pytest.raises(NoCredentialsError) as dataset:
            RecordFileDataset(s3.url("mxnet/raw.rec"), store_options={**_without_credentials(s3), **NO_RETRY})
        errors.append(dataset.value)
    answer = "answered HTTP 403 Forbidden" if metadata == "answers 403" else "could not be reached"
    for err in errors:
        _from_obstore(err)
        text = str(err)
        assert text.startswith(f"s3://{s3.bucket}/"), text
        assert "no AWS credentials were found" in text
        assert f"PUT {endpoint}/latest/api/token, {answer}" in text
        for source in (
            "access_key_id=",
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "metadata_endpoint= or AWS_METADATA_ENDPOINT (default http://169.254.169.254)",
            "does not read ~/.aws/credentials",
            "skip_signature=True",
        ):
            assert source in text, (source, text)
        # not a failure worth retrying: no credentials stay missing
        assert not err.transient and not isinstance(err, (ConnectionError, TransientStoreError))
        assert isinstance(err, StoreSetupError) and err.status is None
    assert errors[0].key == "000.jpg" and (errors[-1].key, errors[-1].url) == ("raw.rec", s3.url("mxnet"))
    if metadata == "answers 403":
        assert seen and set(seen) == {("PUT", "/latest/api/token")}
    # From a worker it arrives whole.
    again = pickle.loads(pickle.dumps(errors[0]))
    assert type(again) is NoCredentialsError and str(again) == str(errors[0]) and again.key == "000.jpg"


def test_plain_http_endpoint_without_allow_http_names_the_option(s3: S3Server) -> None:
    options = {k: v for k, v in s3.options.items() if k != "allow_http"}
    store = ObjectStore(s3.url("jpegs"), **options, **NO_RETRY)
    errors = []
    for read in _reads(store, "000.jpg"):
        with pytest.raises(StoreSetupError) as info:
            read()
        errors.append(info.value)
    with pytest.raises(StoreSetupError) as dataset:
        RecordFileDataset(s3.url("mxnet/raw.rec"), store_options=options)
    errors.append(dataset.value)
    for err in errors:
        _from_obstore(err)
        assert f"the endpoint {s3.endpoint} is plain HTTP" in str(err)
        assert "pass allow_http=True" in str(err) and "store_options=" in str(err)
        assert not err.transient and "builder error" not in str(err)
    # The same store with the option reads (the endpoint itself was fine).
    assert ObjectStore(s3.url("jpegs"), **options, allow_http=True).get_sync("000.jpg")[:2] == b"\xff\xd8"


def test_missing_bucket_is_told_apart_from_missing_key(s3: S3Server) -> None:
    gone = ObjectStore("s3://no-such-bucket/train", **s3.options, **NO_RETRY)
    errors = []
    for read in _reads(gone, "000.jpg"):  # GETs carry S3's error code; the HEAD is followed up
        with pytest.raises(BucketNotFoundError) as info:
            read()
        errors.append(info.value)
    with pytest.raises(BucketNotFoundError) as dataset:
        RecordFileDataset("s3://no-such-bucket/mxnet/raw.rec", store_options=s3.options)
    errors.append(dataset.value)
    for err in errors:
        _from_obstore(err)
        assert f"the bucket 'no-such-bucket' does not exist at {s3.endpoint}" in str(err), str(err)
        assert err.bucket == "no-such-bucket" and err.status == 404
        assert isinstance(err, FileNotFoundError)  # what code that catches a missing object expects
    again = pickle.loads(pickle.dumps(errors[0]))
    assert type(again) is BucketNotFoundError and again.bucket == "no-such-bucket"
    # A missing key in a bucket that exists stays a missing object, also behind a HEAD.
    here = ObjectStore(s3.url("jpegs"), **s3.options, **NO_RETRY)
    for read in _reads(here, "nope.jpg"):
        with pytest.raises(
            FileNotFoundError, match=rf"no such object in s3://{s3.bucket}/jpegs: 'nope\.jpg'"
        ) as miss:
            read()
        assert not isinstance(miss.value, BucketNotFoundError) and miss.value.filename == "nope.jpg"
    with pytest.raises(FileNotFoundError, match=r"'missing\.rec'") as rec:
        RecordFileDataset(s3.url("mxnet/missing.rec"), store_options=s3.options)
    assert not isinstance(rec.value, BucketNotFoundError)


def test_durations_take_seconds(s3: S3Server, jpegs: dict[str, bytes]) -> None:
    store = ObjectStore(
        s3.url("jpegs"),
        **s3.options,
        timeout=30,
        connect_timeout=2.5,
        retry_config={
            "retry_timeout": 20,
            "max_retries": 2,
            "backoff": {"init_backoff": 0.05, "max_backoff": 1},
        },
    )
    assert store.get_sync("000.jpg") == jpegs["000.jpg"] == asyncio.run(store.get("000.jpg"))
    retry = store.client.retry_config
    assert retry is not None and retry["retry_timeout"] == timedelta(seconds=20)
    assert retry["backoff"]["init_backoff"] == timedelta(milliseconds=50)
    assert store.client.client_options == {
        "allow_http": "true",
        "timeout": "30s",
        "connect_timeout": "2s 500ms",
    }
    # What the user passed is what travels to workers.
    assert pickle.loads(pickle.dumps(store)).options["retry_config"]["retry_timeout"] == 20
    # obstore's own spellings still work.
    same = ObjectStore(
        s3.url("jpegs"), **s3.options, timeout="30s", retry_config={"retry_timeout": timedelta(seconds=20)}
    )
    assert same.get_sync("000.jpg") == jpegs["000.jpg"]
    dataset = RecordFileDataset(
        s3.url("mxnet/raw.rec"), store_options={**s3.options, "retry_config": {"retry_timeout": 5}}
    )
    assert len(dataset) > 0


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"retry_config": {"retry_timeout": "3min"}},
            TypeError,
            r'retry_config\["retry_timeout"\] must be seconds',
        ),
        (
            {"retry_config": {"retry_timeout": True}},
            TypeError,
            r'retry_config\["retry_timeout"\] .*got True \(bool\)',
        ),
        (
            {"retry_config": {"retry_timeout": -1}},
            ValueError,
            r'retry_config\["retry_timeout"\] must be a duration of 0 s',
        ),
        (
            {"retry_config": {"backoff": {"max_backoff": "1s"}}},
            TypeError,
            r'retry_config\["backoff"\]\["max_backoff"\]',
        ),
        ({"timeout": [1]}, TypeError, r"timeout must be seconds .*got \[1\] \(list\)"),
        ({"connect_timeout": float("nan")}, ValueError, r"connect_timeout must be a duration"),
        ({"client_options": {"read_timeout": None}}, TypeError, r'client_options\["read_timeout"\] must be'),
    ],
)
def test_bad_durations_name_the_parameter(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=r"^ObjectStore\('s3://bucket'\): " + message):
        ObjectStore("s3://bucket", region="us-east-1", **options)


def test_other_failures_keep_their_classes(s3: S3Server) -> None:
    # The boundary adds setup errors; a range past the end is still a plain, non-transient error.
    store = ObjectStore(s3.url("jpegs"), **s3.options, **NO_RETRY)
    with pytest.raises(ObjectStoreError) as info:
        store.get_range_sync("000.jpg", 10**6, 10**6 + 1)
    assert type(info.value) is ObjectStoreError and info.value.status == 416
    _from_obstore(info.value)


def test_azure_without_credentials_lists_its_sources(
    metadata_403: tuple[str, list[tuple[str, str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No Azure server here: the token request fails first, at a loopback stand-in for the
    # managed-identity endpoint, and the store's own endpoint is a loopback port too.
    for name in list(os.environ):
        if name.startswith("AZURE_"):
            monkeypatch.delenv(name)
    msi, seen = metadata_403
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        store = ObjectStore(
            "az://container/train",
            account_name="account",
            endpoint=f"http://127.0.0.1:{closed.getsockname()[1]}",
            msi_endpoint=msi,
            allow_http=True,
            **NO_RETRY,
        )
        with pytest.raises(NoCredentialsError) as info:
            store.get_sync("a.jpg")
    _from_obstore(info.value)
    text = str(info.value)
    assert text.startswith("az://container/train: no Azure credentials were found to read 'a.jpg'")
    assert f"GET {msi}/?api-version=" in text and "answered HTTP 403 Forbidden" in text
    assert "account_key=" in text and "AZURE_FEDERATED_TOKEN_FILE" in text and "skip_signature=True" in text
    assert seen and all(path.startswith("/?api-version=") for _, path in seen)
