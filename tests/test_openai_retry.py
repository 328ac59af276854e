"""The OpenAI-compatible backend retries through urllib3's Retry, not a loop of its own."""

from __future__ import annotations

from urllib3.util.retry import Retry

from prx_data.columns.backends import RETRY_STATUSES, OpenAIBackend


def test_sessions_mount_urllib3_retry_for_post():
    b = OpenAIBackend("m", base_url="http://127.0.0.1:9/v1", max_retries=4, backoff=0.5)
    try:
        retry = b._session().get_adapter(b.url).max_retries
        assert isinstance(retry, Retry)
        assert retry.total == 4 and retry.read == 4 and retry.connect == 4
        assert retry.allowed_methods is None  # POST is retried
        assert set(retry.status_forcelist) == set(RETRY_STATUSES)
        assert retry.respect_retry_after_header and retry.backoff_jitter > 0
        assert retry.backoff_max == b.max_backoff
        assert not hasattr(b, "_wait")  # no hand-written backoff loop left
    finally:
        b.close()


def test_connection_refused_is_retried_then_reported():
    b = OpenAIBackend(
        "m", base_url="http://127.0.0.1:9/v1", max_retries=2, backoff=0.0, concurrency=1
    )
    try:
        out = b._post({"model": "m"})
        assert isinstance(out, RuntimeError) and str(out) == "http: ConnectionError"
        assert b.retries == 2
    finally:
        b.close()
