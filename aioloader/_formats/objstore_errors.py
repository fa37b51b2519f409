"""Where obstore's exceptions become aioloader's: one boundary for every obstore call.

:mod:`.objstore` runs each obstore call inside :func:`boundary`. It turns obstore's
exception into one of the types below, or a built-in one, and keeps obstore's as the
``__cause__``. Setup mistakes get a message that says what to change: no credentials,
a plain-HTTP endpoint without ``allow_http``, a bucket that does not exist. Nothing
here imports obstore: the boundary reads the exception's type and text only.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "BucketNotFoundError",
    "NoCredentialsError",
    "ObjectStoreError",
    "StoreSetupError",
    "StoreTimeoutError",
    "TransientStoreError",
    "boundary",
    "translate",
]


class ObjectStoreError(OSError):
    """A request to an object store failed; ``key``, ``url`` and ``status`` say which and how.

    ``transient`` is False here; see :class:`TransientStoreError`. ``status`` is the HTTP
    status the server returned, or ``None`` when there was no response. The obstore
    exception is kept as ``__cause__``.
    """

    transient = False

    def __init__(self, message: str, *, key: str | None, url: str, status: int | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.url = url
        self.status = status

    def __reduce__(self) -> Any:
        # Keyword-only arguments defeat the default pickling; the state (``__dict__``)
        # carries the rest, exception notes included.
        return (_rebuild_error, (type(self), str(self), self.key, self.url, self.status), self.__dict__)


class TransientStoreError(ObjectStoreError, ConnectionError):
    """A failure that may pass when tried again: no connection, a dropped one, HTTP 5xx or 429.

    A :class:`ConnectionError` (so generic retry policies treat it as such) with
    ``transient = True``. obstore has already retried the request by then (its
    ``retry_config``), so this means the store stayed unavailable for that long.
    """

    transient = True


class StoreTimeoutError(TransientStoreError, TimeoutError):
    """The request timed out (``timeout``/``connect_timeout`` in the options); transient."""


class StoreSetupError(ObjectStoreError):
    """The store's options or the environment are wrong; the message says what to change.

    Raised for a plain ``http://`` endpoint without ``allow_http=True``; its subclasses
    cover missing credentials and a missing bucket. Not transient: the same request
    fails the same way until the setup changes.
    """


class NoCredentialsError(StoreSetupError):
    """No credentials were found for the store, and none were given.

    The message lists the places obstore looks for them, for this kind of store, and
    what the last one answered. ``status`` is ``None``: the store itself got no request.
    """


class BucketNotFoundError(StoreSetupError, FileNotFoundError):
    """The bucket (or Azure container) of the URL does not exist; ``bucket`` names it.

    Also a :class:`FileNotFoundError`, as a missing object is, so code that catches
    that still catches this. ``errno`` is ``ENOENT``.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None,
        url: str,
        status: int | None = None,
        bucket: str | None = None,
    ) -> None:
        super().__init__(message, key=key, url=url, status=status)
        self.bucket = bucket
        self.errno = errno.ENOENT


def _rebuild_error(
    cls: type[ObjectStoreError], msg: str, key: str | None, url: str, status: int | None
) -> Any:
    return cls(msg, key=key, url=url, status=status)


def _missing(key: str, url: str) -> FileNotFoundError:
    # str(): "[Errno 2] no such object in s3://bucket/prefix: 'key'"; ``filename`` is the key.
    return FileNotFoundError(errno.ENOENT, f"no such object in {url}", key)


_STATUS = re.compile(r"status code: (\d{3})")
_REASON = re.compile(r"status code: (\d{3}[^:\n]*)")
# Failures where the same request may well succeed when tried again: the server was
# unreachable, dropped the connection, or took too long.
_TRANSIENT_TEXT = re.compile(
    r"error sending request|connection (?:reset|refused|closed|aborted)|kind: (?:Connect|Timeout|Request|Interrupted)"
    r"|timed out|timeout|broken pipe|incomplete message|unexpected eof|end of file before",
    re.IGNORECASE,
)
_TIMEOUT_TEXT = re.compile(r"timed out|timeout|kind: Timeout", re.IGNORECASE)
# obstore names the request that failed: "Error performing PUT <uri> in 1.2ms - <why>".
_REQUEST = re.compile(r"Error performing (\w+) (\S+) in \S+ - (.*)")
# Requests that fetch credentials rather than data: the EC2 instance metadata service,
# the ECS container endpoint, STS for web identity, and the Azure and GCS token requests.
# The metadata paths are matched at the root of a host, where no bucket's key can be.
_CREDENTIAL_FETCH = re.compile(
    r"https?://[^/\s]+/latest/(?:api/token|meta-data/iam/security-credentials)|169\.254\.170\.2"
    r"|AssumeRoleWithWebIdentity|https://sts\.[^/\s]*amazonaws\.com"
    r"|Error performing token request|/computeMetadata/"
)
# A plain http:// URL refused by a client that was not told ``allow_http``.
_PLAIN_HTTP = re.compile(r"kind: Builder,\s*source: BadScheme")
_NO_BUCKET = re.compile(r"<Code>(NoSuchBucket|ContainerNotFound)</Code>")
SCHEMES_WITH_BUCKETS = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl")

_SOURCES = {
    "s3": (
        "AWS",
        [
            "the options access_key_id= and secret_access_key= (and session_token=), or credential_provider=",
            "the environment variables AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN)",
            "web identity: AWS_WEB_IDENTITY_TOKEN_FILE with AWS_ROLE_ARN",
            "container credentials: AWS_CONTAINER_CREDENTIALS_RELATIVE_URI or AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "the EC2 instance metadata service at metadata_endpoint= or AWS_METADATA_ENDPOINT "
            "(default http://169.254.169.254)",
        ],
        "obstore does not read ~/.aws/credentials, ~/.aws/config or AWS_PROFILE.\n"
        "To fix: pass access_key_id= and secret_access_key= (ObjectStore options, or a record dataset's "
        "store_options=), or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; for a public "
        "bucket pass skip_signature=True.",
    ),
    "gs": (
        "Google Cloud",
        [
            "the options service_account= (a key file), service_account_key= or bearer_token=, "
            "or credential_provider=",
            "the environment variables GOOGLE_SERVICE_ACCOUNT, GOOGLE_SERVICE_ACCOUNT_KEY and "
            "GOOGLE_APPLICATION_CREDENTIALS",
            "the application default credentials of gcloud",
            "the GCE metadata server",
        ],
        "To fix: pass service_account= or set GOOGLE_APPLICATION_CREDENTIALS; for a public "
        "bucket pass skip_signature=True.",
    ),
    "az": (
        "Azure",
        [
            "the options account_key=, sas_key=, client_id= with client_secret= and tenant_id=, "
            "or credential_provider=",
            "the matching AZURE_STORAGE_* environment variables (AZURE_STORAGE_ACCOUNT_KEY, ...)",
            "workload identity: federated_token_file= or AZURE_FEDERATED_TOKEN_FILE",
            "the Azure CLI, with use_azure_cli=True",
            "managed identity at msi_endpoint= or AZURE_MSI_ENDPOINT (default: the instance metadata service)",
        ],
        "To fix: pass account_key= (or sas_key=), or set AZURE_STORAGE_ACCOUNT_KEY; for a public "
        "container pass skip_signature=True.",
    ),
}


def _scheme(url: str) -> str:
    scheme = url.split("://", 1)[0].lower()
    return {"s3a": "s3", "azure": "az", "abfs": "az", "abfss": "az", "adl": "az"}.get(scheme, scheme)


def bucket_of(url: str) -> str:
    """``"s3://b/prefix"`` -> ``"b"``; an ``abfs://container@account...`` URL gives the container."""
    return url.split("://", 1)[-1].split("/", 1)[0].split("@", 1)[0]


def _why(text: str, first: str) -> str:
    """The failing request and what it got, in a few words: its status, or no connection."""
    m = _REQUEST.search(first)
    status = _REASON.search(first)
    if status is not None:
        what = f"answered HTTP {status.group(1).strip()}"
    elif "kind: Connect" in text:
        what = "could not be reached"
    elif _TIMEOUT_TEXT.search(text):
        what = "timed out"
    else:
        what = f"failed ({m.group(3).strip() if m else first})"
    return f"the last place tried, {m.group(1)} {m.group(2)}, {what}" if m else f"the last place tried {what}"


def _no_credentials(text: str, first: str, key: str | None, url: str) -> NoCredentialsError:
    scheme = _scheme(url)
    what, sources, fix = _SOURCES.get(scheme, ("", [], "To fix: pass credentials in the store options."))
    lines = [f"{url}: no {what + ' ' if what else ''}credentials were found"]
    if key is not None:
        lines[0] += f" to read {key!r}"
    lines[0] += f"; {_why(text, first)}."
    if sources:
        lines.append("obstore looks for them in this order:")
        lines += [f"  - {source}{';' if n < len(sources) else '.'}" for n, source in enumerate(sources, 1)]
    lines.append(fix)
    return NoCredentialsError("\n".join(lines), key=key, url=url)


_REQUEST_URI = re.compile(r"Error performing \w+ (\S+) in ")


def _endpoint(first: str) -> str | None:
    """``scheme://host:port`` of the request obstore names in ``first``, if it names one."""
    m = _REQUEST_URI.search(first)
    return "/".join(m.group(1).split("/", 3)[:3]) if m else None


def _plain_http(first: str, key: str | None, url: str) -> StoreSetupError:
    endpoint = _endpoint(first) or url
    return StoreSetupError(
        f"{url}: the endpoint {endpoint} is plain HTTP, which obstore refuses unless allowed: pass "
        "allow_http=True (an ObjectStore option, or in a record dataset's store_options=)",
        key=key,
        url=url,
    )


def _no_bucket(first: str, key: str | None, url: str) -> BucketNotFoundError:
    bucket = bucket_of(url)
    word = "container" if _scheme(url) == "az" else "bucket"
    endpoint = _endpoint(first)
    at = f" at {endpoint}" if endpoint else ""
    reading = f" (reading {key!r})" if key is not None else ""
    return BucketNotFoundError(
        f"{url}: the {word} {bucket!r} does not exist{at}{reading}; check the {word} name "
        "in the URL, and the endpoint and region the store was given",
        key=key,
        url=url,
        status=404,
        bucket=bucket,
    )


_TRIES = re.compile(r"retries: (\d+),\s*max_retries: \d+,\s*elapsed: ([\d.]+)(ns|µs|us|ms|s)\b")
_REFUSED = re.compile(r"ConnectionRefused|connection refused", re.IGNORECASE)
_SCALE = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def _tried(text: str) -> str:
    """``" (3 tries over 41.2 s)"`` from obstore's retry record, or ``""``."""
    m = _TRIES.search(text)
    if m is None:
        return ""
    tries, elapsed = int(m.group(1)) + 1, float(m.group(2)) * _SCALE[m.group(3)]
    return f" ({tries} {'try' if tries == 1 else 'tries'} over {elapsed:.1f} s)"


def _unreachable(text: str, first: str, key: str | None, url: str, answer_s: float | None) -> BaseException | None:
    """A request that got no answer, said in words: refused, or nothing within the timeout."""
    where = url if key is None else f"{key!r} in {url}"
    endpoint = _endpoint(first) or url
    if _REFUSED.search(text):
        return TransientStoreError(
            f"{where}: connection refused by {endpoint}{_tried(text)}", key=key, url=url
        )
    if _TIMEOUT_TEXT.search(text):
        within = f" within {answer_s:g} s" if answer_s is not None else ""
        return StoreTimeoutError(
            f"{where}: no answer from {endpoint}{within}{_tried(text)}; the ObjectStore options "
            "timeout= and retry_config= bound one read",
            key=key,
            url=url,
        )
    if "kind: Connect" in text:
        return TransientStoreError(f"{where}: could not connect to {endpoint}{_tried(text)}", key=key, url=url)
    return None


def translate(err: BaseException, key: str | None, url: str, answer_s: float | None = None) -> BaseException:
    """obstore's exception for a request on ``key`` as one of ours (``err`` is kept as the
    cause); ``answer_s``: the seconds one request waits for an answer (for the message)."""
    if isinstance(err, ObjectStoreError):
        return err
    where = url if key is None else f"{key!r} in {url}"
    # obstore's text of a retried request names its "retry_timeout": not a timeout.
    text = re.sub(r"retry_timeout: \S+", "", str(err))
    first = text.split("\n", 1)[0].strip()
    if _CREDENTIAL_FETCH.search(first):
        return _no_credentials(text, first, key, url)
    if _PLAIN_HTTP.search(text):
        return _plain_http(first, key, url)
    m = _STATUS.search(first)
    status = int(m.group(1)) if m else None
    if isinstance(err, FileNotFoundError) or (status == 404 and key is not None):
        if _NO_BUCKET.search(text) and _scheme(url) in SCHEMES_WITH_BUCKETS:
            return _no_bucket(first, key, url)
        if key is not None:
            return _missing(key, url)
        return FileNotFoundError(errno.ENOENT, first, url)
    message = f"{where}: {first}"
    if status is not None and (status >= 500 or status == 429):
        return TransientStoreError(message, key=key, url=url, status=status)
    if status is None:
        said = _unreachable(text, first, key, url, answer_s)
        if said is not None:
            return said
    if status is None and _TRANSIENT_TEXT.search(text):
        cls = StoreTimeoutError if _TIMEOUT_TEXT.search(text) else TransientStoreError
        return cls(message, key=key, url=url)
    if isinstance(err, (ValueError, TypeError)):
        return type(err)(message)
    return ObjectStoreError(message, key=key, url=url, status=status)


@contextmanager
def boundary(
    key: str | None, url: str, *, making: bool = False, answer_s: float | None = None
) -> Iterator[None]:
    """Run one obstore call: whatever it raises leaves as :func:`translate` maps it.

    A plain context manager, so it wraps awaits as well as blocking calls. With
    ``making``, the call makes the store: a failure there is a bad URL or option, so
    it leaves as :class:`ValueError` with obstore's first line.
    """
    try:
        yield
    except Exception as err:
        if making:
            raise ValueError(f"ObjectStore({url!r}): {str(err).splitlines()[0]}") from err
        mapped = translate(err, key, url, answer_s)
        if mapped is err:
            raise
        raise mapped from err
