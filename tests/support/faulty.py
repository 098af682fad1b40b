"""HTTP servers that misbehave as broken engines do, on loopback threads of the test process."""

from __future__ import annotations

import http.server
import json
import socketserver
import threading
import time
from typing import Any


class Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        return

    def drain(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)

    def send(self, status: int, data: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class NotJson(Quiet):
    """200 with a JSON content type and an HTML body, as a misrouted gateway answers."""

    def _answer(self) -> None:
        self.drain()
        body = b"<html><body>502 Bad Gateway</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


class Endless(Quiet):
    """An event every 50 ms and never [DONE]."""

    def _answer(self) -> None:
        self.drain()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        event = b'data: {"text": "a", "output_ids": [1], "meta_info": {}}\n\n'
        try:
            while True:
                self.wfile.write(event)
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            return

    do_GET = do_POST = _answer


class Bursty(Quiet):
    """SGLang's stream shape with three tokens to an event, 60 ms apart: what a speculative
    decoder that accepts its drafts, or `--stream-interval 3`, sends. 12 tokens in 4 events."""

    def _answer(self) -> None:
        self.drain()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        ids: list[int] = []
        for event in range(4):
            ids += [event * 3 + 1, event * 3 + 2, event * 3 + 3]
            meta = {"prompt_tokens": 4, "completion_tokens": len(ids)}
            if event == 3:
                # A speculative decoder's verification steps, on the last event as SGLang sends
                # them: 12 tokens in 4 steps.
                meta["finish_reason"] = {"type": "length", "length": 12}
                meta["spec_verify_ct"] = 4
            body = {"text": "x" * len(ids), "output_ids": ids, "meta_info": meta}
            self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.06)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    do_POST = _answer


def miscounting(streamed: int, claimed: int) -> type[Quiet]:
    """SGLang's stream shape of 0.4.10 to 0.5.5 (each event the new id, the text cumulative),
    `streamed` token ids to a request while its last meta_info counts `claimed` completion
    tokens: an engine that counts draft tokens as output, or (`streamed` short of the length
    asked) one that stops early despite ignore_eos."""

    class Miscounting(Quiet):
        def do_POST(self) -> None:
            self.drain()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(streamed):
                meta: dict[str, Any] = {"prompt_tokens": 4, "completion_tokens": i + 1}
                if i == streamed - 1:
                    meta["completion_tokens"] = claimed
                    meta["finish_reason"] = {"type": "length", "length": claimed}
                body = {"text": "x" * (i + 1), "output_ids": [i + 1], "meta_info": meta}
                self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.01)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def do_GET(self) -> None:
            if self.path in ("/server_info", "/model_info"):
                return self.send(200, b'{"model_path": "/models/tiny"}')
            return self.send(200 if self.path == "/health" else 404, b"{}")

    return Miscounting


def recorded(body: dict[str, Any], models: tuple[str, ...] = ("tiny",)) -> type[Quiet]:
    """A handler answering every POST with one recorded JSON body, as an engine's source shows
    it answers (tests/fixtures/sglang), and GET /v1/models with `models`."""

    class Recorded(Quiet):
        def _json(self, value: Any) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            self.drain()
            self._json(body)

        def do_GET(self) -> None:
            self._json({"object": "list", "data": [{"id": m, "object": "model"} for m in models]})

    return Recorded


def release(fixture: dict[str, Any]) -> type[Quiet]:
    """A handler answering as one SGLang release's recorded shapes
    (tests/fixtures/sglang/generate/): /generate whole or streamed, its info routes or their 404,
    and a prompt that does not fit the context (`"text": "too long"`) as that release refuses it."""

    class Release(Quiet):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError:
                err = fixture["schema_error"]
                return self.send(err["status"], json.dumps(err["body"]).encode())
            too_long = body.get("text") == "too long"
            if body.get("stream"):
                events = fixture["bad_input_stream"]["events"] if too_long else fixture["stream"]
                data = "".join(f"{e}\n\n" for e in events).encode()
                return self.send(200, data, "text/event-stream")
            if too_long:
                err = fixture["bad_input"]
                return self.send(err["status"], json.dumps(err["body"]).encode())
            return self.send(200, json.dumps(fixture["answer"]).encode())

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                cards = [{"id": "tiny", "object": "model", "max_model_len": 2048}]
                return self.send(200, json.dumps({"object": "list", "data": cards}).encode())
            status = fixture["routes"].get(self.path)
            if status != 200:
                return self.send(404, b'{"detail": "Not Found"}')
            info = {"model_path": "/models/tiny", "served_model_name": "tiny", "tp_size": 1}
            info |= {"context_length": None, "version": fixture["sglang"]}
            return self.send(200, json.dumps(info).encode())

    return Release


def replay(answers: dict[tuple[str, str], tuple[int, bytes, str]]) -> type[Quiet]:
    """A handler sending recorded bodies as they were sent, by (method, path); 404 elsewhere."""

    class Replay(Quiet):
        def _answer(self, method: str) -> None:
            self.drain()
            path = self.path.split("?")[0]
            self.send(
                *answers.get((method, path), (404, b'{"detail":"Not Found"}', "application/json"))
            )

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

    return Replay


def closing(handler: type[Quiet], *, answered: int) -> type[Quiet]:
    """`handler` over HTTP/1.1 keep-alive, closing each connection unanswered once it has
    answered `answered` requests on it: what uvicorn (SGLang, vLLM) does to a request sent on a
    connection just as it closes it for having been idle its 5 s, made certain. `dropped`
    counts the requests closed unanswered."""

    class Closing(handler):  # type: ignore[misc,valid-type]
        protocol_version = "HTTP/1.1"
        dropped = 0

        def handle(self) -> None:
            for _ in range(answered):
                self.handle_one_request()
                if self.close_connection:
                    return
            if self.rfile.readline():  # a request came: its line is read, nothing answered
                with _COUNT:
                    type(self).dropped += 1

    return Closing


_COUNT = threading.Lock()


def serve(handler: type[Quiet]) -> socketserver.ThreadingTCPServer:
    """Started on a free loopback port; `server_address[1]` is the port, `shutdown()` ends it."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
