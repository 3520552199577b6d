"""One retry policy for every call to the Hub (`push`, Hub datasets): a transient failure is tried again, after
2 s and then 4 s (longer when a 429 says Retry-After, at most 60 s), three tries in all; anything else fails at once.

Transient: connection errors and timeouts (httpx2's TransportError under huggingface_hub 2, httpx's under 1; the
builtin ConnectionError / TimeoutError that `datasets` wraps them in) and HTTP 408, 429 and 5xx gateway errors.
Permanent: 401/403/404, missing repos, files or splits, bad formats, and anything while HF_HUB_OFFLINE is set.
huggingface_hub 2.4 already retries a failed file request itself (5 times, about 23 s) before datasets gives up;
these tries cover the rest: the other requests, and outages longer than that.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TypeVar

WAITS = (2, 4)  # seconds before the 2nd and 3rd try
TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)
MAX_RETRY_AFTER = 60  # seconds: a longer Retry-After is not waited out
sleep = time.sleep  # tests replace it to record the waits instead of sleeping

T = TypeVar("T")


class GaveUp(Exception):
    """`error` ended the calls after `attempts` tries: it was permanent, or still transient at the last try."""

    def __init__(self, error: Exception, attempts: int):
        super().__init__(describe(error))
        self.error, self.attempts = error, attempts


def call(step: Callable[[], T], label: str, log=print, waits: tuple[float, ...] | None = None,
         catch: tuple[type[BaseException], ...] = (Exception,)) -> T:
    """`step()`, retried while it fails transiently; raises GaveUp for an error in `catch` (others propagate as they are).

    `label` starts each retry line the user sees ("push: the Hub failed (HTTP 503: ...); retrying in 2 s (try 2 of 3)").
    """
    waits = WAITS if waits is None else waits
    for attempt, wait in enumerate((*waits, None), start=1):
        try:
            return step()
        except catch as e:
            if wait is None or not transient(e):
                raise GaveUp(e, attempt) from e
            wait = _retry_after(e, wait)
            log(f"{label}: the Hub failed ({describe(e)}); retrying in {wait} s (try {attempt + 1} of {len(waits) + 1})")
            sleep(wait)


def transient(error: BaseException) -> bool:
    """Whether trying again may help. Decided by the first link of the chain (the error, what it was raised from or
    while handling) that has an HTTP status or is a connection error: `datasets` 5.2 turns a 503 into
    FileNotFoundError("Couldn't find 'ID' on the Hub either: LocalEntryNotFoundError ...") raised while handling it."""
    link = _decisive(error)
    if link is None:
        return False
    if status(link) is not None:
        return status(link) in TRANSIENT_STATUS
    return not _offline()  # offline, a "connection" error is the offline switch: trying again cannot help


def status(error: BaseException) -> int | None:
    response = _response(_decisive(error) or error)
    return response.status_code if response is not None else None


def describe(error: BaseException) -> str:
    """One line: `HTTP 503: <the server's message>`, or the text of the (decisive) exception."""
    error = _decisive(error) or error
    response = _response(error)
    if response is not None:
        message = getattr(error, "server_message", None) or response.reason_phrase
        return " ".join(f"HTTP {response.status_code}: {message}".split())
    return " ".join(str(error).split()) or type(error).__name__


def _decisive(error: BaseException) -> BaseException | None:
    seen, todo = set(), [error]
    while todo:
        link = todo.pop(0)
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        if _response(link) is not None or isinstance(link, (transport_error(), ConnectionError, TimeoutError)):
            return link
        todo += [link.__cause__, link.__context__]
    return None


def _retry_after(error: BaseException, wait: float) -> float:
    response = _response(_decisive(error) or error)
    after = response.headers.get("Retry-After", "") if response is not None else ""
    return max(wait, min(int(after), MAX_RETRY_AFTER)) if after.isdigit() else wait  # a rate limit (429) may say how long


def _response(error: BaseException):
    from huggingface_hub.errors import HfHubHTTPError

    return error.response if isinstance(error, HfHubHTTPError) else None


def transport_error() -> type:
    # Connection errors and timeouts: huggingface_hub 2 talks through httpx2, huggingface_hub 1 through httpx
    try:
        from httpx2 import TransportError
    except ImportError:
        from httpx import TransportError
    return TransportError


def _offline() -> bool:
    from huggingface_hub import constants

    # datasets keeps its own switch (HF_DATASETS_OFFLINE too), and words its offline error as a ConnectionError
    datasets_config = sys.modules.get("datasets.config")
    return constants.is_offline_mode() or bool(getattr(datasets_config, "HF_HUB_OFFLINE", False))
