"""A stand-in for ``vllm serve`` on localhost: the endpoints ``VLLMServerEngine`` uses, answered in the server's
formats, with programmable delays and failures. It records every request, so tests can check what reached it."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Behaviour:
    """How the fake server answers: ``fail`` HTTP 500s first (then it recovers; -1: never), a random delay of up
    to ``max_delay`` s per completion, ``model`` and ``max_model_len`` in ``/v1/models``, the ``vocabulary`` of its
    one-id-per-character tokenizer, ``malformed`` completions without their token ids, HTTP 500s always on
    ``fail_paths``."""

    fail: int = 0
    max_delay: float = 0.0
    model: str = "policy"
    max_model_len: int = 4096
    malformed: bool = False
    vocabulary: int = 50
    fail_paths: set[str] = field(default_factory=set)
    requests: list[tuple[str, Any]] = field(default_factory=list)


def fake_ids(text: str, vocabulary: int = 50) -> list[int]:
    """The fake tokenizer: one id per character."""
    return [ord(character) % vocabulary for character in text]


def fake_tokens(prompt: list[int], seed: int, length: int = 3) -> list[int]:
    """The response the fake server gives ``prompt`` under ``seed``: a function of both, so a test knows it."""
    return [(sum(prompt) + seed * 7 + step) % 50 + 1 for step in range(length)]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        behaviour = self.server.behaviour
        behaviour.requests.append((self.path, None))
        if self.path == "/metrics":
            data = b'vllm:num_requests_running{model_name="policy"} 2.0\nvllm:num_requests_waiting{m="p"} 3.0\n'
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/v1/models":
            self._answer(200, {"data": [{"id": behaviour.model, "max_model_len": behaviour.max_model_len}]})
        else:
            self._answer(200, {})

    def do_POST(self) -> None:
        behaviour = self.server.behaviour
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        behaviour.requests.append((self.path, body))
        with self.server.lock:
            failing = behaviour.fail != 0 or self.path in behaviour.fail_paths
            if behaviour.fail > 0:
                behaviour.fail -= 1
        if failing:
            self._answer(500, {"error": {"message": "engine core died"}})
        elif self.path == "/v1/completions":
            time.sleep(random.uniform(0, behaviour.max_delay))
            self._answer(200, _completion(body, behaviour.malformed))
        elif self.path == "/tokenize":
            self._answer(200, {"tokens": fake_ids(body["prompt"], behaviour.vocabulary), "count": 0,
                               "max_model_len": behaviour.max_model_len})  # fmt: skip
        elif self.path == "/reset_prefix_cache":
            self._answer(200, {"success": True})
        else:
            self._answer(200, {"results": []})


def _completion(body: dict[str, Any], malformed: bool) -> dict[str, Any]:
    prompt = body["prompt"]
    if body.get("prompt_logprobs") is not None:
        entries = [None] + [{str(token): {"logprob": -0.5}} for token in prompt[1:]]
        return {"choices": [{"token_ids": [1], "prompt_logprobs": entries, "finish_reason": "length"}]}
    tokens = fake_tokens(prompt, body["seed"])
    choice: dict[str, Any] = {"finish_reason": "stop" if body["seed"] % 2 else "length"}
    if not malformed:
        choice["token_ids"] = tokens
    if body.get("logprobs") is not None:
        choice["logprobs"] = {"token_logprobs": [-0.1 * (i + 1) for i in range(len(tokens))]}
    return {"choices": [choice]}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, behaviour: Behaviour) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.behaviour = behaviour
        self.lock = threading.Lock()


class FakeVLLMServer:
    """A fake server on a free localhost port, in a thread; ``url`` is its base URL; ``stop`` closes its port."""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self._server = _Server(self.behaviour)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def paths(self) -> list[str]:
        return [path for path, _ in self.behaviour.requests]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
