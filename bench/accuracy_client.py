"""The pdserve side of `pdserve bench accuracy`: OpenAI requests, --concurrency at a time.

Plain blocking HTTP (urllib) on a thread pool: the answers are whole JSON bodies, not streams, so
neither the streaming client (http_client.py) nor the openai package (a test dependency only) is
needed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass
class Answer:
    body: dict | None  # the response body; None when the request failed
    error: str = ""


class OpenAIEndpoint:
    """POSTs JSON to http://HOST:PORT/v1/...; `model` goes into every body."""

    def __init__(self, base_url: str, model: str, api_key: str = "", timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def post(self, path: str, body: dict) -> Answer:
        data = json.dumps({"model": self.model, **body}).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return Answer(json.loads(response.read()))
        except urllib.error.HTTPError as e:
            return Answer(None, f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}")
        except (OSError, ValueError) as e:  # refused, reset, timed out; a body that is not JSON
            return Answer(None, f"{type(e).__name__}: {e}")

    def post_all(self, path: str, bodies: list[dict], concurrency: int) -> list[Answer]:
        """Every body POSTed to `path`, at most `concurrency` in flight; the answers in body order."""
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(lambda body: self.post(path, body), bodies))


def first_model(base_url: str, api_key: str = "", timeout: float = 30.0) -> str:
    """The first id of GET /v1/models."""
    request = urllib.request.Request(
        base_url.rstrip("/") + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())["data"][0]["id"]
