"""What the serving tests share: a server answering from a thread of the test process, and a
plain-HTTP POST."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Any, Iterator

from lucidlm.serving import OpenAIServer

NAME = "smollm2-135m"
SERVING_THREAD = "test-serving-thread"  # the thread that runs serve_forever, so the model's work


@contextmanager
def served(model: Any, **options: Any) -> Iterator[OpenAIServer]:
    """An ``OpenAIServer`` for ``model`` on a free port, serving from a thread named SERVING_THREAD
    until the block ends."""
    server = OpenAIServer(model, NAME, port=0, **options)
    thread = threading.Thread(target=server.serve_forever, name=SERVING_THREAD, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def post(server: OpenAIServer, path: str, body: dict) -> tuple[int, Any]:
    """(status, JSON body) of a POST; a streamed answer as the list of its events' JSON."""
    host, port = server.server_address[:2]
    request = urllib.request.Request(f"http://{host}:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            data = response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    if not body.get("stream"):
        return 200, json.loads(data)
    events = [line[len("data: "):] for line in data.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return 200, [json.loads(event) for event in events[:-1]]
