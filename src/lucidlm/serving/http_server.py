"""The HTTP side of ``lucidlm serve``: the stdlib's ``ThreadingHTTPServer`` (a thread per
connection), JSON in and out, Server-Sent Events for ``"stream": true``.

One model has one KV cache, so one generation runs at a time: a request holds the model
(``FairLock``, first come, first served) from its first token to its last, and requests that
arrive meanwhile wait. With ``parallel`` > 1 the request that gets the model takes along the
waiting requests that can decode in one batch with it (``batching.py``), and, with
``cont_batching``, requests that arrive while it runs take over its ended rows; the batch decodes
on the model's thread and lets go of the model at its end, and each request's thread writes its
own rows' pieces. Every generation runs on the model's thread, the one that called ``serve_forever``
(``model_worker.py``); the connections' threads only read and write. A client that goes away is
noticed when its turn comes (it ran out of patience in the queue: nothing runs for it), at the
next event written (streaming) or at the next piece of text (not streaming): its generation (in a
batch, its rows) is closed there and the model passes to the next request.

Routes: ``GET /health``, ``GET /v1/models`` (and ``/v1/models/NAME``), ``POST /v1/completions``,
``POST /v1/chat/completions``, each but /health also without ``/v1`` as llama-server has them;
``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (``tokenizer_routes.py``);
``HEAD`` of a GET route, and ``OPTIONS`` of any (a browser's CORS preflight: a page of any origin
may call the API, as llama-server's and vLLM's defaults allow).
Every error is OpenAI's error object with its status: 400 a bad field, 404 an unknown path, 405
a wrong method, 411 no Content-Length, 413 a body over 16 MiB, 503 "Loading model" while the model
loads (llama-server's), 500 a bug (the server goes on), and the stdlib's own refusals (501 an
unknown method, 400 a request line it cannot read).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Optional
from urllib.parse import unquote, urlsplit

from lucidlm.errors import LucidLMError
from lucidlm.serving import tokenizer_routes
from lucidlm.serving.api_errors import RequestError, as_request_error, server_error
from lucidlm.serving.batching import BatchMember, Joining, batch_member, joiner, start_batch
from lucidlm.serving.fair_lock import FairLock
from lucidlm.serving.model_worker import ModelWorker
from lucidlm.serving.openai_protocol import GenerationJob, parse_chat_request, parse_completion_request

MAX_BODY = 16 * 2 ** 20  # bytes of JSON a request may send (a prompt that long is far past any context)
# A refused body up to this size is still read to its end, so the client gets its 413 rather than
# a connection reset while it sends; a larger one is not worth the reading.
MAX_DRAINED = 64 * 2 ** 20
ROUTES = {"/health": {"GET": "health"}, "/v1/models": {"GET": "models"},
          "/v1/completions": {"POST": "completions"}, "/v1/chat/completions": {"POST": "chat_completions"},
          "/tokenize": {"POST": "tokenize"}, "/detokenize": {"POST": "detokenize"},
          "/tokenizer_info": {"GET": "tokenizer_info"}}  # the last three: vLLM's and llama-server's
# rows a batch of waiting requests may decode together (--parallel): llama-server's default slots; SmolLM2,
# 2 cores: generate_batch gives 2.6x one row's tokens a second at 4 rows, 3.7x at 8 (2026-12-07), each row
# slower the more rows share a step
DEFAULT_PARALLEL = 4
MODEL_PATH = "/v1/models/"  # + a model's name: that model
# llama-server also answers these without /v1 (clients given a base URL without it)
UNVERSIONED = ("/completions", "/chat/completions", "/models")
# the client closed its connection, or stalled a read or write past the handler's timeout
_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class OpenAIServer(ThreadingHTTPServer):
    """``OpenAIServer(model, "smollm2-135m", port=0)`` listens at once; ``serve_forever()``
    answers; ``url`` is the base URL a client takes (``http://127.0.0.1:PORT/v1``). ``model``
    may be set after (``lucidlm serve`` binds its port before it loads the model), as may
    ``generation_options``: ``generate`` options every request runs with, its own fields on top
    (``{"draft": "prompt"}``: speculative decoding by prompt lookup, which no OpenAI field asks for).
    ``cont_batching``: with ``parallel`` > 1, a request that comes while a batch runs takes over
    rows that have ended (``batching.Joining``); else it waits for the next batch."""

    daemon_threads = True  # an open connection does not keep the process alive after Ctrl-C
    # connections the kernel holds until they are accepted: socketserver's 5 drops a burst's others,
    # which retry after 1, 3, 7 s... (300 at once: half missed the openai client's 5 s to connect)
    request_queue_size = 1024

    def __init__(self, model: Any, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 log_requests: bool = False, generation_options: Optional[dict[str, Any]] = None,
                 parallel: int = DEFAULT_PARALLEL, cont_batching: bool = True) -> None:
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel={parallel!r} is invalid: use a whole number >= 1, the most rows a batch of "
                             f"waiting requests decodes together (1: one request at a time).")
        self.parallel = parallel
        self.batches: Counter[int] = Counter()  # rows a batch began with (2 or more) -> batches of that size run
        self.model_turn = FairLock()
        self.joining = Joining(self.model_turn) if cont_batching else None  # .joined: requests that joined under way
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.model = model
        self.generation_options = dict(generation_options or {})  # under every request's (e.g. draft="prompt")
        self.model_name = model_name
        self.log_requests = log_requests
        self.created = int(time.time())
        self.worker = ModelWorker()  # the model's one thread: serve_forever's caller (model_worker.py says why)
        self._http: Optional[threading.Thread] = None  # the thread accepting connections, once started
        super().__init__((host, port), OpenAIRequestHandler)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Answer requests until ``shutdown()``: the connections in threads of their own, every
        generation on the calling thread, which should be the one that loaded the model (another
        thread generates ~3.7x slower on a 2-core CPU: ``model_worker.py``)."""
        http = self.start_accepting(poll_interval)
        try:
            self.worker.run(keep_going=http.is_alive)
        finally:  # Ctrl-C (or a bug) in the model's work: stop accepting too
            self.stop_accepting()

    def start_accepting(self, poll_interval: float = 0.5) -> threading.Thread:
        """Answer connections from now on, in a thread of their own (``lucidlm serve`` starts
        before it loads the model: meanwhile every route answers 503 "Loading model", as
        llama-server's do, instead of leaving the client's connection unanswered)."""
        if self._http is None:
            self._http = threading.Thread(target=super().serve_forever, args=(poll_interval,), name="lucidlm-http",
                                          daemon=True)
            self._http.start()
        return self._http

    def stop_accepting(self) -> None:
        if self._http is not None and self._http.is_alive():
            super().shutdown()

    def count_batch(self, rows: int) -> None:
        self.batches[rows] += 1
        if self.log_requests:
            print(f"lucidlm serve: a batch of {rows} rows", file=sys.stderr, flush=True)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


class OpenAIRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the openai client sends its requests on one connection
    server_version = "lucidlm-serve"
    timeout = 600  # seconds a connection may sit idle, or a client stall reading, before its thread gives up
    server: OpenAIServer

    def do_GET(self) -> None:
        self.respond("GET")

    def do_HEAD(self) -> None:  # a GET without its body (uptime monitors, curl -I)
        self.respond("HEAD")

    def do_OPTIONS(self) -> None:
        self.respond("OPTIONS")

    def do_POST(self) -> None:
        self.respond("POST")

    def do_PUT(self) -> None:
        self.respond("PUT")

    def do_DELETE(self) -> None:
        self.respond("DELETE")

    def do_PATCH(self) -> None:
        self.respond("PATCH")

    def respond(self, method: str) -> None:
        self.streaming = False  # set once the 200 of an event stream is sent: errors go in the stream then
        try:
            self.body = self.read_body()
            path = self.route = self.route_of(urlsplit(self.path).path)
            methods = ROUTES.get(path) or ({"GET": "model"} if path.startswith(MODEL_PATH) else None)
            if self.server.model is None and methods is not None and method != "OPTIONS":
                raise RequestError("Loading model: the server answers once its model is loaded; retry in a moment.",
                                   status=503, kind="unavailable_error")
            if methods is None:
                raise RequestError(f"no such endpoint: {path}; this server has {', '.join(ROUTES)}.", status=404,
                                   code="not_found")
            if method == "OPTIONS":
                return self.preflight(methods)
            if method == "HEAD" and "GET" in methods:
                method = "GET"  # send_json leaves the body out
            if method not in methods:
                allowed = ", ".join(methods)
                self.allow = allowed
                raise RequestError(f"{method} {path} is not allowed; use {allowed}.", status=405,
                                   code="method_not_allowed")
            getattr(self, methods[method])()
        except RequestError as exc:
            self.fail(exc)
        except LucidLMError as exc:  # generate's checks past start(): still the request's fault
            self.fail(as_request_error(exc))
        except _GONE:
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - a bug: say so, log it, keep serving
            traceback.print_exc(file=sys.stderr)
            self.fail(server_error(exc))

    # ---------------------------------------------------------------- endpoints
    def health(self) -> None:
        self.send_json(200, {"status": "ok"})

    def models(self) -> None:
        self.send_json(200, {"object": "list", "data": [self.model_card()]})

    @staticmethod
    def route_of(path: str) -> str:
        """The route a path asks for: itself, or the /v1 path llama-server's unversioned alias names."""
        return "/v1" + path if path in UNVERSIONED or path.startswith("/models/") else path

    def model(self) -> None:
        name = unquote(self.route[len(MODEL_PATH):])
        if name != self.server.model_name:
            raise RequestError(f"model {name!r} is not served here; this server serves {self.server.model_name!r}.",
                               status=404, param="model", code="model_not_found")
        self.send_json(200, self.model_card())

    def tokenize(self) -> None:  # tokenizing needs no turn of the model: the tokenizer is thread-safe
        self.send_json(200, tokenizer_routes.tokenize(self.server.model, self.json_body()))

    def detokenize(self) -> None:
        self.send_json(200, tokenizer_routes.detokenize(self.server.model, self.json_body()))

    def tokenizer_info(self) -> None:
        self.send_json(200, tokenizer_routes.tokenizer_info(self.server.model))

    def completions(self) -> None:
        self.generate(parse_completion_request)

    def chat_completions(self) -> None:
        self.generate(parse_chat_request)

    def model_card(self) -> dict[str, Any]:
        return {"id": self.server.model_name, "object": "model", "created": self.server.created, "owned_by": "lucidlm"}

    def generate(self, parse: Callable[[dict[str, Any]], GenerationJob]) -> None:
        job = parse(self.json_body())  # a bad field is refused before the request waits for the model
        server = self.server
        member = batch_member(job, server.model, server.generation_options, server.parallel)
        if not server.model_turn.acquire(member):  # taken along into the batch of the request ahead of it
            return self.answer_in_batch(member)
        try:
            if self.client_gone():  # it gave up while it waited (a client's timeout, Ctrl-C): run nothing for nobody
                raise ConnectionAbortedError("the client closed its connection")
            riders = server.model_turn.take_along(joiner(server.model, member, server.parallel)) if member else []
        except BaseException:
            server.model_turn.release()
            raise
        if riders or (member is not None and server.joining is not None):  # alone, others may still join it
            members = [member, *riders]
            if riders or len(member.rows) > 1:
                server.count_batch(sum(len(m.rows) for m in members))
            start_batch(server.model, members, server.model_turn.release, server.worker,  # it lets go of the model
                        server.joining, server.parallel)
            return self.answer_in_batch(member)
        try:  # alone: its generations opened and stepped on the model's thread, their pieces written from here
            server.worker.call(job.start, server.model, server.model_name, server.generation_options)
            for choice in job.choices:
                choice.pieces = server.worker.stream(choice.pieces)
            self.answer(job)
        finally:
            server.model_turn.release()

    def answer_in_batch(self, member: BatchMember) -> None:
        """Answer from the rows the batch decodes for this request on the model's thread."""
        member.job.start_in_batch(self.server.model, self.server.model_name, member.feeds)
        if self.client_gone():  # gone while it waited: its rows end at the batch's next step
            member.job.close()
            raise ConnectionAbortedError("the client closed its connection")
        self.answer(member.job)

    def answer(self, job: GenerationJob) -> None:
        try:
            if job.stream:
                self.send_events(job.chunks())
            else:
                self.send_json(200, job.response(abandoned=self.client_gone))
        finally:
            job.close()  # a client gone mid-stream: its generation stops here, before the next request's

    def client_gone(self) -> bool:
        """Whether the client has closed its connection: an end of file waits on the socket (a
        request it sent on behind this one would be data, not an end)."""
        timeout = self.connection.gettimeout()
        self.connection.settimeout(0)  # a look, no wait (select() would refuse a descriptor past 1023)
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:  # nothing to read: still there
            return False
        except OSError:  # reset by the client
            return True
        finally:
            self.connection.settimeout(timeout)

    # ---------------------------------------------------------------- reading
    def read_body(self) -> bytes:
        """The request's body, read in full (on a kept-alive connection, an unread body would be
        taken for the next request)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise RequestError("the body came in chunks (Transfer-Encoding: chunked); send it with a Content-Length "
                               "header.", status=411, code="length_required")
        length_header = self.headers.get("Content-Length", "0")
        try:
            length = int(length_header)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            raise RequestError(f"Content-Length {length_header!r} is not a length in bytes.")
        if length > MAX_BODY:
            self.close_connection = True
            if length <= MAX_DRAINED:
                while length > 0 and (data := self.rfile.read(min(length, 2 ** 20))):
                    length -= len(data)
            raise RequestError(f"the request body is {int(length_header)} bytes, more than the {MAX_BODY} bytes "
                               f"(16 MiB) this server reads.", status=413, code="request_too_large")
        return self.rfile.read(length) if length else b""

    def json_body(self) -> dict[str, Any]:
        if not self.body:
            raise RequestError("the request has no body; send a JSON object (with a Content-Length header).")
        try:
            body = json.loads(self.body)
        except (UnicodeDecodeError, ValueError) as exc:
            raise RequestError(f"the request body is not JSON ({exc}); send a JSON object.") from None
        except RecursionError:
            raise RequestError("the request body is JSON nested too deeply to read; send a flat JSON object.") \
                from None
        if not isinstance(body, dict):
            raise RequestError(f"the request body is a JSON {type(body).__name__}, not an object; send "
                               f'{{"model": ..., ...}}.')
        return body

    def preflight(self, methods: dict[str, str]) -> None:
        """OPTIONS: the methods the path takes; to a browser's CORS preflight, that its page may
        send them with the headers it asks for (the openai package sends Authorization and
        X-Stainless-* headers of its own)."""
        self.send_response(204)
        self.send_header("Allow", ", ".join(methods))
        self.send_header("Access-Control-Allow-Methods", ", ".join(methods))
        if "Access-Control-Request-Headers" in self.headers:
            self.send_header("Access-Control-Allow-Headers", self.headers["Access-Control-Request-Headers"])
        self.send_header("Access-Control-Max-Age", "86400")  # a day before the browser asks again
        self.send_header("Content-Length", "0")
        self.end_headers()

    # ---------------------------------------------------------------- writing
    def send_response(self, code: int, message: Optional[str] = None) -> None:
        super().send_response(code, message)
        self.send_header("Access-Control-Allow-Origin", "*")  # a web page may read the answers (see preflight)

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """The stdlib's own refusals, before any route (``FOO /v1/models``, a request line it
        cannot read, headers too long), as OpenAI's error object rather than an HTML page."""
        self.close_connection = True  # what follows on the connection cannot be read as a request
        self.streaming = False
        fix = "use GET or POST (HEAD and OPTIONS too)" if code == 501 else "send a well-formed HTTP/1.1 request"
        self.fail(RequestError(f"{message or HTTPStatus(code).phrase}; {fix}.", status=code))

    def send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode("utf-8")  # ASCII with \u escapes: any text, even a lone surrogate
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 405:
            self.send_header("Allow", self.allow)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_events(self, chunks: Iterable[dict[str, Any]]) -> None:
        """Server-Sent Events, ``data: {chunk}`` each, then ``data: [DONE]``; sent as HTTP/1.1
        chunks, so the connection stays open for the client's next request. An HTTP/1.0 client
        (nginx's proxy_pass unless told otherwise) knows no chunks: its stream ends with the
        connection."""
        self.chunked = self.request_version != "HTTP/1.0"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        if self.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        self.streaming = True
        for chunk in chunks:
            self.send_event(json.dumps(chunk))
        self.send_event("[DONE]")
        self.end_events()

    def send_event(self, data: str) -> None:
        event = f"data: {data}\n\n".encode("utf-8")
        # one HTTP chunk (its length in hex, then it); to HTTP/1.0, the event as it is
        self.wfile.write(b"%x\r\n%b\r\n" % (len(event), event) if self.chunked else event)

    def end_events(self) -> None:
        if self.chunked:
            self.wfile.write(b"0\r\n\r\n")  # the chunk of length 0 ends the body
        self.streaming = False

    def fail(self, error: RequestError) -> None:
        """The error as JSON with its status, or, inside an event stream already under way, as an
        event (the openai client raises it) that ends the stream."""
        try:
            if self.streaming:
                self.send_event(json.dumps(error.body()))
                self.end_events()
            else:
                self.send_json(error.status, error.body())
        except _GONE:
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        if self.server.log_requests:
            super().log_message(format, *args)


def serve(server: OpenAIServer, on_stop: Optional[Callable[[], None]] = None) -> None:
    """``server.serve_forever()`` until Ctrl-C (or SIGTERM, as ``kill`` and service managers send
    it), then ``on_stop``; the caller closes the server."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    in_main = threading.current_thread() is threading.main_thread()  # signals can only be caught there
    previous = signal.signal(signal.SIGTERM, interrupt) if in_main else None
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        if on_stop is not None:
            on_stop()
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
