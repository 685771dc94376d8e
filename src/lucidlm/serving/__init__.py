"""``lucidlm serve``: OpenAI's HTTP API on one lucidlm model, stdlib only (llama.cpp's
``llama-server`` for lucidlm).

Where things are: ``openai_protocol.py`` a request's JSON, checked, run with
``generation.stream`` and answered as OpenAI's objects (``request_fields.py`` the fields every
endpoint shares, ``chat_messages.py`` the chat's ``messages``, ``logprob_objects.py`` the two
shapes of log-probs); ``http_server.py`` the routes, the request body, Server-Sent Events and
one generation at a time (``fair_lock.py``), or one batch of waiting requests (``batching.py``,
``row_feed.py``), all of it on the serving thread (``model_worker.py``); ``tokenizer_routes.py``
the tokenizer's routes; ``api_errors.py`` errors in OpenAI's shape.

>>> server = OpenAIServer(lucidlm.load(), "smollm2-135m", port=0)
>>> server.serve_forever()   # serve from the thread that loaded the model: another decodes ~3x slower
>>> # elsewhere: openai.OpenAI(base_url=server.url, api_key="none").completions.create(...)
"""

from lucidlm.serving.http_server import OpenAIServer

__all__ = ["OpenAIServer"]
