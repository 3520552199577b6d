"""Hub datasets: transient network failures are retried (the policy `push` uses, erniekit_lite/retry.py), permanent
ones are not, and what finally fails is one line naming the dataset id and the cause. No network: `load_dataset`
is replaced by a stand-in, or talks to a local server that answers as a failing Hub does."""

from __future__ import annotations

import http.server
import threading

import httpx2
import pytest
from huggingface_hub.errors import HfHubHTTPError

from erniekit_lite import retry
from erniekit_lite.data.load import read_records
from erniekit_lite.errors import DataError

DATASET = "someone/chat-data"


def http_error(code: int, headers: dict | None = None) -> HfHubHTTPError:
    request = httpx2.Request("GET", f"https://huggingface.co/datasets/{DATASET}/resolve/main/README.md")
    return HfHubHTTPError(f"{code} error", response=httpx2.Response(code, headers=headers or {}, request=request))


def raised_while_handling(inner: Exception, outer: Exception) -> Exception:
    """`outer` as datasets 5.2 raises it: `raise outer from None` while handling `inner` (kept as __context__)."""
    try:
        try:
            raise inner
        except Exception:
            raise outer from None
    except Exception as e:
        return e


# What datasets 5.2 raised for each failure, measured against a local server (see the last test)
UNREACHABLE = ConnectionError(f"Couldn't reach '{DATASET}' on the Hub (LocalEntryNotFoundError)")
SERVER_ERROR = raised_while_handling(http_error(503), FileNotFoundError(
    f"Couldn't find any data file at /x/{DATASET}. "
    f"Couldn't find '{DATASET}' on the Hugging Face Hub either: LocalEntryNotFoundError"))


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The retry policy's waits, recorded instead of slept."""
    waited: list[float] = []
    monkeypatch.setattr(retry, "sleep", waited.append)
    return waited


@pytest.fixture
def hub_load(monkeypatch):
    """Replaces datasets.load_dataset: fails with the queued errors in turn, then returns two rows."""
    import datasets

    calls: list[tuple] = []
    failures: list[Exception] = []

    def load_dataset(path, split=None, **kwargs):
        calls.append((path, split))
        if failures:
            raise failures.pop(0)
        return [{"instruction": "hi", "output": "hello"}, {"instruction": "bye", "output": "goodbye"}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls, failures


def test_transient_failures_are_retried_then_the_data_loads(hub_load, waits, capsys):
    calls, failures = hub_load
    failures += [UNREACHABLE, SERVER_ERROR]
    records = read_records(DATASET)
    assert [r.data["output"] for r in records] == ["hello", "goodbye"] and records[0].path == f"{DATASET}[train]"
    assert len(calls) == 3 and waits == [2, 4]
    assert capsys.readouterr().err.splitlines() == [
        f"data {DATASET}: the Hub failed (Couldn't reach '{DATASET}' on the Hub (LocalEntryNotFoundError)); "
        "retrying in 2 s (try 2 of 3)",
        f"data {DATASET}: the Hub failed (HTTP 503: Service Unavailable); retrying in 4 s (try 3 of 3)",  # the 503 inside
    ]


def test_a_rate_limit_waits_as_long_as_the_hub_asks(hub_load, waits):
    calls, failures = hub_load
    failures += [http_error(429, {"Retry-After": "7"}), http_error(429, {"Retry-After": "3600"})]
    assert len(read_records(DATASET)) == 2
    assert waits == [7, retry.MAX_RETRY_AFTER]


def test_still_failing_after_the_last_try_is_one_line_naming_the_id(hub_load, waits):
    calls, failures = hub_load
    failures += [http_error(502)] * 5
    with pytest.raises(DataError) as failure:
        read_records(DATASET)
    assert str(failure.value) == (f"{DATASET}: loading it as a Hub dataset failed 3 times (HTTP 502: Bad Gateway); "
                                  "check the connection (or HF_ENDPOINT) and start again")
    assert len(calls) == 3 and waits == [2, 4]


@pytest.mark.parametrize(("error", "cause"), [
    (None, f"Dataset '{DATASET}' doesn't exist on the Hub or cannot be accessed."),  # DatasetNotFoundError: 404, gated, no access
    (http_error(401), "HTTP 401: Unauthorized"),
    (http_error(404), "HTTP 404: Not Found"),
    (ValueError("Unknown split \"test\". Should be one of ['train']."), "Unknown split \"test\". Should be one of ['train']."),
], ids=["not-found", "401", "404", "bad-split"])
def test_a_permanent_failure_is_not_retried(hub_load, waits, error, cause):
    from datasets.exceptions import DatasetNotFoundError

    calls, failures = hub_load
    failures.append(error or DatasetNotFoundError(cause))
    with pytest.raises(DataError) as failure:
        read_records(DATASET, split="test")
    assert str(failure.value) == f"{DATASET}: not a local file, and loading it as a Hub dataset failed: {cause}"
    assert len(calls) == 1 and waits == []


def test_offline_a_connection_error_is_not_retried(hub_load, waits, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    calls, failures = hub_load
    failures.append(ConnectionError(f"Couldn't reach the Hugging Face Hub for dataset '{DATASET}': offline mode is enabled."))
    with pytest.raises(DataError, match=f"^{DATASET}: not a local file, and loading it as a Hub dataset failed: Couldn't reach"):
        read_records(DATASET)
    assert len(calls) == 1 and waits == []


class FailingHub(http.server.BaseHTTPRequestHandler):
    """Answers every request with `status` (and `error_code` as the Hub's X-Error-Code header)."""

    status, error_code = 503, None

    def do_GET(self):
        self.send_response(self.status)
        if self.error_code:
            self.send_header("X-Error-Code", self.error_code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_real_datasets_errors_are_classified(waits, monkeypatch, tmp_path):
    """The real load_dataset against a local server: the exception types datasets 5.2 / huggingface_hub 2.4 raise."""
    import datasets
    import huggingface_hub.constants

    import huggingface_hub.utils._http

    # huggingface_hub retries each request 5 times itself (time.sleep: its module imports `time`, so this is global)
    monkeypatch.setattr(huggingface_hub.utils._http.time, "sleep", lambda seconds: None)
    for module, name in ((huggingface_hub.constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE")):
        monkeypatch.setattr(module, name, False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    calls = []
    load_dataset = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a) or load_dataset(*a, **k))

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FailingHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for status, code, expected, tries in [
            (503, None, "failed 3 times (HTTP 503: Service Unavailable)", 3),
            (404, "RepoNotFound", f"failed: Dataset '{DATASET}' doesn't exist on the Hub or cannot be accessed.", 1),
        ]:
            FailingHub.status, FailingHub.error_code = status, code
            monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
            calls.clear(), waits.clear()
            with pytest.raises(DataError) as failure:
                read_records(DATASET)
            assert f"{DATASET}: " in str(failure.value) and expected in str(failure.value), str(failure.value)
            assert len(calls) == tries and len(waits) == tries - 1
        # Nothing listens: a refused connection is retried too
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", "http://127.0.0.1:1")
        calls.clear(), waits.clear()
        with pytest.raises(DataError, match=f"^{DATASET}: loading it as a Hub dataset failed 3 times \\(Couldn't reach"):
            read_records(DATASET)
        assert len(calls) == 3
    finally:
        server.shutdown()
