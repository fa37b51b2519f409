"""Object stores (S3, GCS, Azure, HTTP, local) through obstore; the contract is in :mod:`aioloader.io`.

This module runs on both sides: its coroutines on the consumer's event loop (the fetch
stage), its ``*_sync`` methods inside workers. It awaits obstore's own coroutines and
never imports asyncio itself. obstore is imported only when a store is made.
"""

from __future__ import annotations

import atexit
import math
import os
import re
import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .objstore_errors import (
    SCHEMES_WITH_BUCKETS,
    BucketNotFoundError,
    NoCredentialsError,
    ObjectStoreError,
    StoreSetupError,
    StoreTimeoutError,
    TransientStoreError,
    boundary,
    translate,
)

if TYPE_CHECKING:
    import obstore.store

__all__ = [
    "INSTALL_HINT",
    "BucketNotFoundError",
    "NoCredentialsError",
    "ObjectStore",
    "ObjectStoreError",
    "StoreSetupError",
    "StoreTimeoutError",
    "TransientStoreError",
    "is_url",
    "split_url",
    "translate",
]

INSTALL_HINT = 'reading from object stores needs obstore: pip install "aioloader[remote]"'

# URL schemes obstore's from_url understands (``memory://`` is left out: a store that
# lives in one process cannot be shared with workers).
SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "http", "https", "file")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

# The keys of obstore's ClientConfig (a type that exists only in its stubs). They are
# HTTP-client settings, not store settings, so they go to ``client_options``: this lets a
# caller write ObjectStore(url, allow_http=True, endpoint=...) in one flat list.
_CLIENT_KEYS = frozenset(
    "allow_http allow_invalid_certificates connect_timeout default_content_type "
    "default_headers http1_only http2_keep_alive_interval http2_keep_alive_timeout "
    "http2_keep_alive_while_idle http2_only pool_idle_timeout pool_max_idle_per_host "
    "proxy_url proxy_ca_certificate proxy_excludes root_certificate randomize_addresses "
    "read_timeout timeout user_agent".split()
)


def is_url(path: object) -> bool:
    """True when ``path`` is a string with a URL scheme obstore can open."""
    if not isinstance(path, str):
        return False
    m = _URL.match(path)
    return m is not None and m.group(1).lower() in SCHEMES


def split_url(url: str) -> tuple[str, str]:
    """``"s3://b/data/train.rec"`` -> ``("s3://b/data", "train.rec")``: the folder and the key."""
    m = _URL.match(url)
    rest = url[m.end() :] if m else url
    if "/" not in rest.rstrip("/") or url.endswith("/"):
        raise ValueError(f"not an object URL (it names no object after the bucket or host): {url!r}")
    base, _, name = url.rpartition("/")
    return base, name


def _hand_over_at_exit() -> None:
    # obstore's runtime threads finish each async request by dropping Python objects,
    # for which they wait for the GIL. A thread that gets it while the interpreter is
    # finalizing is ended by a forced unwind, which Rust turns into abort(): a script that
    # exits right after an async request died with SIGABRT about one time in five here.
    # Releasing the GIL a few times before finalization lets those threads finish (20 ms
    # at most; measured: 15 in 80 runs aborted without this, 0 in 80 with it, also with
    # requests still in flight at exit).
    for _ in range(20):
        time.sleep(0.001)


_exit_hook = [False]


def _before_async_request() -> None:
    if not _exit_hook[0]:
        _exit_hook[0] = True
        atexit.register(_hand_over_at_exit)


def _import_obstore() -> Any:
    try:
        import obstore
        import obstore.store
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return obstore


def _bytes(buf: Any) -> bytes:
    return bytes(buf) if not isinstance(buf, bytes) else buf


_live_stores: weakref.WeakSet[ObjectStore] = weakref.WeakSet()
# obstore starts its Rust (tokio) runtime with the first request a process makes, and that
# runtime does not survive a fork: its threads are gone in the child, where every request
# would wait forever. ``_runtime["pid"]`` is the process that started it; a child forked
# after that refuses requests with an error instead of hanging.
_runtime = {"pid": 0, "inherited": False}

FORK_MESSAGE = (
    "obstore cannot make requests in a process forked after its parent made some (its "
    "runtime's threads do not survive fork); use the forkserver or spawn start method "
    "(aioloader's default), or make the first request after the fork"
)


def _forget_clients() -> None:
    # A forked child must not use the parent's client (its connection pool belongs to the
    # parent); it builds its own on first use, unless the runtime itself is the parent's.
    if _runtime["pid"] and _runtime["pid"] != os.getpid():
        _runtime["inherited"] = True
    for store in list(_live_stores):
        store._client = None
        store._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_clients)


class ObjectStore:
    """The objects under one URL: ``s3://bucket/prefix``, ``gs://``, ``az://``, ``http(s)://``, ``file://``.

    ``options`` go to obstore's ``from_url``: store settings (``endpoint``, ``region``,
    ``access_key_id``, ``skip_signature``, ``virtual_hosted_style_request``...), HTTP
    client settings (``allow_http``, ``timeout``, ``connect_timeout``... are recognised
    and passed as ``client_options``), or ``client_options=``, ``retry_config=`` as
    obstore takes them. Credentials not given are read from the environment as obstore
    does. Keys are paths relative to the URL.

    The client is made at construction (so a bad URL or option fails in the caller),
    again in each process that unpickles the store, and again after a fork. Pickling
    sends the URL and the options.

    Durations (``timeout``, ``connect_timeout``... and ``retry_config``'s
    ``retry_timeout``, ``backoff.init_backoff``, ``backoff.max_backoff``) take seconds
    as an int or a float, or a :class:`datetime.timedelta`; the client's also take
    obstore's duration strings (``"300ms"``).

    Errors: a missing object raises :class:`FileNotFoundError` naming the key and the
    URL; a missing bucket :class:`BucketNotFoundError` (also a FileNotFoundError)
    naming the bucket. Setup mistakes raise :class:`StoreSetupError`, saying what to
    change: :class:`NoCredentialsError` lists where credentials were looked for, and a
    plain ``http://`` endpoint asks for ``allow_http=True``. A failure worth retrying
    raises :class:`TransientStoreError` (a :class:`ConnectionError`, ``transient =
    True``; :class:`StoreTimeoutError` for timeouts); any other failure
    :class:`ObjectStoreError`. obstore's exception is the ``__cause__`` of each.
    """

    def __init__(self, url: str, **options: Any) -> None:
        if not isinstance(url, str) or not is_url(url):
            schemes = ", ".join(f"{s}://" for s in SCHEMES)
            raise ValueError(f"ObjectStore: url must start with one of {schemes}; got {url!r}")
        stripped = url.rstrip("/")
        # "file:///" (the root) keeps its slashes; elsewhere a trailing slash means nothing.
        self.url = stripped if not stripped.endswith(":") else stripped + "///"
        self.options = dict(options)
        self._lock = threading.Lock()
        self._client: obstore.store.ObjectStore | None = None
        self._pid = 0
        self._answer_s: float | None = None  # seconds one request waits for an answer
        self._connect()
        _live_stores.add(self)

    def _connect(self) -> Any:
        obstore = _import_obstore()
        store_opts = dict(self.options)
        client = _durations(
            dict(store_opts.pop("client_options", None) or {}), 'client_options["{}"]', self.url
        )
        for name in list(store_opts):
            if name in _CLIENT_KEYS:
                client[name] = store_opts.pop(name)
                client.update(_durations({name: client[name]}, "{}", self.url))
        retry = store_opts.get("retry_config")
        if retry is not None and not isinstance(retry, dict):
            raise TypeError(
                f"ObjectStore({self.url!r}): retry_config must be a dict with the keys "
                f"{', '.join(sorted(_RETRY_KEYS))}; got {retry!r} ({type(retry).__name__})"
            )
        if self.url.split("://", 1)[0].lower() != "file":  # (a local store has no client)
            for name, value in _CLIENT_DEFAULTS.items():
                client.setdefault(name, value)
            store_opts["retry_config"] = {**_RETRY_DEFAULTS, **(retry or {})}
        if isinstance(store_opts.get("retry_config"), dict):
            store_opts["retry_config"] = _retry_durations(store_opts["retry_config"], self.url)
        self._answer_s = _seconds(client.get("timeout"))
        with boundary(None, self.url, making=True):
            made = obstore.store.from_url(self.url, client_options=client or None, **store_opts)
        self._client, self._pid = made, os.getpid()
        return made

    def _boundary(self, key: str) -> Any:
        return boundary(key, self.url, answer_s=self._answer_s)

    @property
    def client(self) -> obstore.store.ObjectStore:
        """This process's obstore client (made on first use here).

        Raises :class:`ObjectStoreError` in a process forked after its parent made
        requests: obstore's runtime cannot work there (it would hang).
        """
        if _runtime["inherited"]:
            raise ObjectStoreError(f"{self.url}: {FORK_MESSAGE}", key=None, url=self.url)
        _runtime["pid"] = os.getpid()
        client = self._client
        if client is None or self._pid != os.getpid():
            with self._lock:
                client = self._client
                if client is None or self._pid != os.getpid():
                    client = self._connect()
        return client

    # -- reading
    async def get(self, key: str) -> bytes:
        """The whole object ``key``."""
        obstore, client = _import_obstore(), self.client
        _before_async_request()
        with self._boundary(key):
            result = await obstore.get_async(client, key)
            return _bytes(await result.bytes_async())

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key``, fewer where the object ends before ``end``.

        ``start == end`` gives ``b""`` without a request. :class:`ValueError` for a
        negative or reversed range; :class:`ObjectStoreError` (HTTP 416) when ``start``
        is past the end of the object.
        """
        if _empty_range(key, start, end):
            return b""
        obstore, client = _import_obstore(), self.client
        _before_async_request()
        with self._boundary(key):
            return _bytes(await obstore.get_range_async(client, key, start=start, end=end))

    def get_sync(self, key: str) -> bytes:
        """:meth:`get`, blocking (for worker-side code)."""
        obstore, client = _import_obstore(), self.client
        with self._boundary(key):
            return _bytes(obstore.get(client, key).bytes())

    def get_range_sync(self, key: str, start: int, end: int) -> bytes:
        """:meth:`get_range`, blocking (for worker-side code)."""
        if _empty_range(key, start, end):
            return b""
        obstore, client = _import_obstore(), self.client
        with self._boundary(key):
            return _bytes(obstore.get_range(client, key, start=start, end=end))

    def size_sync(self, key: str) -> int:
        """The size of ``key`` in bytes (one HEAD request).

        A HEAD answer has no body, so a 404 does not say whether the bucket or the key
        is missing. For a store with buckets, one ranged GET of the key then tells.
        """
        obstore, client = _import_obstore(), self.client
        try:
            with self._boundary(key):
                return int(obstore.head(client, key)["size"])
        except FileNotFoundError as missing:
            if (
                isinstance(missing, BucketNotFoundError)
                or self.url.split("://")[0].lower() not in SCHEMES_WITH_BUCKETS
            ):
                raise
            try:
                with self._boundary(key):
                    obstore.get_range(client, key, start=0, end=1)
            except BucketNotFoundError:
                raise
            except Exception:
                pass  # the key is missing (or this GET failed otherwise): the HEAD's answer stands
            raise

    # -- pickling: the URL and the options
    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url = state["url"]
        self.options = state["options"]
        self._lock = threading.Lock()
        self._client = None  # made on first use in this process
        self._pid = 0
        self._answer_s = None
        _live_stores.add(self)

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"


# Defaults that bound one request of a store over the network, obstore's retries
# included: a store that accepts connections and never answers ends a read within about
# 3 x 20 s (obstore's own defaults: 30 s a try, retried for up to 180 s). Options given
# take precedence, key by key.
_CLIENT_DEFAULTS = {"timeout": timedelta(seconds=20), "connect_timeout": timedelta(seconds=5)}
_RETRY_DEFAULTS: dict[str, Any] = {"max_retries": 2, "retry_timeout": timedelta(seconds=30)}
_RETRY_KEYS = frozenset(("max_retries", "retry_timeout", "backoff"))
_BACKOFF_KEYS = frozenset(("init_backoff", "max_backoff", "base"))
# Durations a client takes in obstore's strings: a number and a unit, repeated ("1m 30s").
_DURATION_TEXT = re.compile(
    r"^\s*(?:\d+(?:\.\d+)?\s*(?:ns|us|µs|ms|s|sec|secs|m|min|mins|h|hr|hrs|d|days?)\s*)+$"
)
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "secs": 1.0, "m": 60.0,
           "min": 60.0, "mins": 60.0, "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "d": 86400.0,
           "day": 86400.0, "days": 86400.0}  # fmt: skip


def _text_seconds(text: str) -> float:
    return sum(
        float(n) * _UNIT_S[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)\s*([a-zµ]+)", text)
    )


def _seconds(value: Any) -> float | None:
    """A checked duration in seconds (a timedelta or an obstore duration string)."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, str):
        return _text_seconds(value)
    return None


# The HTTP client's durations; obstore takes a datetime.timedelta or a duration string
# ("300ms") there, and only a timedelta in retry_config. A number means seconds here.
_CLIENT_DURATIONS = frozenset(
    "connect_timeout http2_keep_alive_interval http2_keep_alive_timeout pool_idle_timeout read_timeout timeout".split()
)


def _duration(value: Any, name: str, url: str, strings: bool, positive: bool = False) -> Any:
    if isinstance(value, str) and strings:
        if not _DURATION_TEXT.match(value):
            raise ValueError(
                f"ObjectStore({url!r}): {name} must be seconds (an int or a float), a "
                f"datetime.timedelta or a duration string such as '300ms' or '1m 30s'; got {value!r}"
            )
        if positive and _text_seconds(value) <= 0:
            raise ValueError(f"ObjectStore({url!r}): {name} must be more than 0 s; got {value!r}")
        return value
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        kinds = "seconds (an int or a float)"
        kinds += (
            ", a datetime.timedelta or a duration string such as '300ms'"
            if strings
            else " or a datetime.timedelta"
        )
        raise TypeError(
            f"ObjectStore({url!r}): {name} must be {kinds}; got {value!r} ({type(value).__name__})"
        )
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"ObjectStore({url!r}): {name} must be a duration of 0 s or more; got {value!r}")
    if positive and seconds == 0:
        raise ValueError(
            f"ObjectStore({url!r}): {name} must be more than 0 s (0 would fail every request); got {value!r}"
        )
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def _durations(options: dict[str, Any], name: str, url: str) -> dict[str, Any]:
    """``options`` with each HTTP-client duration checked; numbers become timedeltas."""
    return {
        key: _duration(value, name.format(key), url, True, key in _POSITIVE)
        if key in _CLIENT_DURATIONS
        else value
        for key, value in options.items()
    }


# A client duration of 0 makes every request fail at once.
_POSITIVE = frozenset(("timeout", "connect_timeout", "read_timeout"))


def _retry_durations(config: dict[str, Any], url: str) -> dict[str, Any]:
    """``retry_config`` with its durations checked; numbers (seconds) become timedeltas."""
    out = dict(config)
    unknown = sorted(set(out) - _RETRY_KEYS, key=str)
    if unknown:
        raise ValueError(
            f"ObjectStore({url!r}): retry_config has no key {unknown[0]!r}; its keys are "
            f"{', '.join(sorted(_RETRY_KEYS))}"
        )
    if "max_retries" in out:
        n = out["max_retries"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise TypeError(
                f'ObjectStore({url!r}): retry_config["max_retries"] must be an int >= 0; '
                f"got {n!r} ({type(n).__name__})"
            )
    if "backoff" in out and not isinstance(out["backoff"], dict):
        raise TypeError(f'ObjectStore({url!r}): retry_config["backoff"] must be a dict; got {out["backoff"]!r}')
    if isinstance(out.get("backoff"), dict):
        unknown = sorted(set(out["backoff"]) - _BACKOFF_KEYS, key=str)
        if unknown:
            raise ValueError(
                f'ObjectStore({url!r}): retry_config["backoff"] has no key {unknown[0]!r}; its keys '
                f"are {', '.join(sorted(_BACKOFF_KEYS))}"
            )
    if "retry_timeout" in out:
        out["retry_timeout"] = _duration(out["retry_timeout"], 'retry_config["retry_timeout"]', url, False)
    if isinstance(out.get("backoff"), dict):
        backoff = out["backoff"] = dict(out["backoff"])
        for key in ("init_backoff", "max_backoff"):
            if key in backoff:
                name = f'retry_config["backoff"]["{key}"]'
                backoff[key] = _duration(backoff[key], name, url, False)
    return out


def _empty_range(key: str, start: int, end: int) -> bool:
    if start < 0 or end < start:
        raise ValueError(f"invalid byte range [{start}, {end}) for {key!r}")
    return start == end
