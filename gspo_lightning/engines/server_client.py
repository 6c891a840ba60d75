"""Requests to vLLM's OpenAI-compatible servers (``vllm serve``) and their RL endpoints, with bounded retries.

Token ids in and out: a request's prompt is its token ids, the response carries the sampled ids
(``return_token_ids``) and their log-probs, so nothing is re-tokenized. A round's requests are spread over the
servers group by group (a prompt's G requests on one server share its prefill through the prefix cache) and its
results are put back by row, so the order never depends on the servers' timing.

A request that fails (no answer, a dropped connection, an HTTP error) is sent again, to the next server, until
``retry_seconds`` have passed; then the run stops with one line naming the server and what it said.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from gspo_lightning.engines.base import SamplingSettings
from gspo_lightning.engines.vllm_routes import decode_routes
from gspo_lightning.validation import UserError


class ServerError(UserError):
    """A vLLM server did not answer, or answered with an error, for longer than the retry budget: reported in one
    line, as a bad setting is (the fix is on the server's side or in ``sampler.engine``), not as a bug."""


@dataclass(frozen=True)
class Completion:
    """One sampled response: its token ids, whether it ended with EOS, the log-prob of each token (or None)."""

    token_ids: list[int]
    ended: bool
    logprobs: list[float] | None
    routes: np.ndarray | None = None  # [prompt + response - 1, decoder layers, k], when asked for


def post(url: str, path: str, body: dict[str, Any] | None, timeout: float, as_json: bool = True) -> Any:
    """POST ``body`` (JSON) to ``url + path``; the decoded JSON answer (None for an empty one), or its text."""
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - the user's own servers
        text = response.read()
    if not as_json:
        return text.decode(errors="replace")
    return json.loads(text) if text else None


def get(url: str, path: str, timeout: float, as_json: bool = True) -> Any:
    with urllib.request.urlopen(url + path, timeout=timeout) as response:  # noqa: S310 - the user's own servers
        text = response.read()
    if not as_json:
        return text.decode(errors="replace")
    return json.loads(text) if text else None


@dataclass
class RequestFigures:
    """One server's completions since the figures were last taken: how many, their summed latency, the tokens
    they generated."""

    requests: int = 0
    latency_s: float = 0.0
    tokens: int = 0


def queue_depth(prometheus: str) -> float:
    """Requests running or waiting on a server, from its ``/metrics`` text (vLLM's ``num_requests_*`` gauges)."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    return sum(float(line.rsplit(" ", 1)[1]) for line in prometheus.splitlines() if line.startswith(names))


def describe(error: BaseException) -> str:
    """What a server said, in one line: its HTTP status and message, or why nothing came back."""
    if isinstance(error, urllib.error.HTTPError):
        body = error.read().decode(errors="replace").strip().replace("\n", " ")
        return f"HTTP {error.code}: {body[:300]}"
    if isinstance(error, urllib.error.URLError):
        return f"no answer ({error.reason})"
    return f"{type(error).__name__}: {error}"


class Servers:
    """The vLLM servers a run samples from (their base URLs, e.g. ``http://10.0.0.5:8000``).

    Args:
        urls: the servers' base URLs.
        request_timeout: seconds one request may take before it counts as failed.
        retry_seconds: how long a failing request keeps being retried (on the other servers too) before the run
            stops.
        model: the served model's name (``--served-model-name``).

    Attributes:
        adapter: the name of the LoRA adapter the completions sample with (None: the served model itself).
    """

    def __init__(self, urls: Sequence[str], request_timeout: float, retry_seconds: float, model: str) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self.request_timeout = request_timeout
        self.retry_seconds = retry_seconds
        self.model = model
        self.adapter: str | None = None
        self._figures = [RequestFigures() for _ in self.urls]
        self._sampling_s = 0.0
        self._lock = threading.Lock()

    def call(self, index: int, path: str, body: dict[str, Any] | None = None, failover: bool = False,
             as_json: bool = True) -> Any:  # fmt: skip
        """POST to server ``index`` (with ``failover``: to the next servers in turn while it fails), retried until
        ``retry_seconds`` have passed; then a ``ServerError`` naming the last server tried and what it said. The
        answer decoded from JSON, or (``as_json=False``) its text."""
        deadline = time.monotonic() + self.retry_seconds
        attempt = 0
        while True:
            server = (index + attempt) % len(self.urls) if failover else index
            url = self.urls[server]
            try:
                sent = time.perf_counter()
                answer = post(url, path, body, self.request_timeout, as_json)
                if path == "/v1/completions":
                    self._record(server, time.perf_counter() - sent, answer)
                return answer
            except (OSError, ValueError) as error:  # URLError and HTTPError are OSErrors; bad JSON a ValueError
                said = describe(error)
                if time.monotonic() >= deadline:
                    raise ServerError(
                        f"vLLM server {url} failed on {path}: {said} (retried for {self.retry_seconds:g} s: "
                        "sampler.engine.retry_seconds)"
                    ) from None
            attempt += 1
            time.sleep(min(2.0, 0.1 * 2**attempt))

    def complete(self, prompts: list[list[int]], settings: SamplingSettings, group_size: int, with_logprobs: bool,
                 seed: int, with_routes: bool = False) -> list[Completion]:  # fmt: skip
        """``group_size`` responses per prompt, prompt-major (row i * G + g), each request seeded ``seed + row``;
        ``with_routes``: with each one's routed experts (servers started with ``--enable-return-routed-experts``)."""
        rows = [(prompt_index, prompt) for prompt_index, prompt in enumerate(prompts) for _ in range(group_size)]

        def one(row: int) -> Completion:
            prompt_index, prompt = rows[row]
            body = completion_request(self.adapter or self.model, prompt, settings, with_logprobs, seed + row)
            answer = self.call(prompt_index % len(self.urls), "/v1/completions", body, failover=True)
            return parse_completion(answer, with_logprobs, with_routes)

        workers = max(1, min(len(rows), 64))
        started = time.perf_counter()
        with ThreadPoolExecutor(workers, thread_name_prefix="vllm-server-request") as pool:
            completions = list(pool.map(one, range(len(rows))))  # map keeps the rows' order
        with self._lock:
            self._sampling_s += time.perf_counter() - started
        return completions

    def _record(self, server: int, latency: float, answer: Any) -> None:
        try:
            tokens = len(answer["choices"][0]["token_ids"])
        except (KeyError, IndexError, TypeError):
            tokens = 0  # a malformed answer is refused by parse_completion
        with self._lock:
            figures = self._figures[server]
            figures.requests += 1
            figures.latency_s += latency
            figures.tokens += tokens

    def take_figures(self) -> dict[str, float]:
        """Per server since the last call: ``server<i>/requests``, ``latency_s`` (mean per request),
        ``tokens_per_s`` (generated tokens per second of sampling), and ``queue_depth`` now (requests running or
        waiting, from ``/metrics``; NaN when the server does not answer it)."""
        with self._lock:
            figures, self._figures = self._figures, [RequestFigures() for _ in self.urls]
            sampling_s, self._sampling_s = self._sampling_s, 0.0
        taken: dict[str, float] = {}
        for index, server in enumerate(figures):  # the same names every time: ranks gather them together
            taken[f"server{index}/requests"] = server.requests
            taken[f"server{index}/latency_s"] = server.latency_s / max(server.requests, 1)
            taken[f"server{index}/tokens_per_s"] = server.tokens / sampling_s if sampling_s else 0.0
            try:
                taken[f"server{index}/queue_depth"] = queue_depth(get(self.urls[index], "/metrics", 5, False))
            except (OSError, ValueError, IndexError):
                # a figure, not a reason to stop: a dead server is reported by the next request
                taken[f"server{index}/queue_depth"] = float("nan")
        return taken

    def prompt_logprobs(self, index: int, ids: list[int], model: str | None = None) -> list[float]:
        """The log-probs (temperature 1) server ``index`` gives tokens 1.. of ``ids``, each given those before,
        under ``model`` (a LoRA adapter's name; None: the served model)."""
        body = {"model": model or self.model, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0,
                "seed": 0, "return_token_ids": True}  # fmt: skip
        entries = self.call(index, "/v1/completions", body)["choices"][0]["prompt_logprobs"][1:]
        return [float(entry[str(token)]["logprob"]) for token, entry in zip(ids[1:], entries)]

    @contextmanager
    def paused(self, index: int) -> Iterator[None]:
        """Server ``index`` with generation paused (requests in flight finish first) while its weights change; then
        its prefix cache reset (blocks of the old weights must not serve the new ones) and generation resumed."""
        self.call(index, "/pause?mode=wait")
        try:
            yield
            if not (self.call(index, "/reset_prefix_cache") or {}).get("success", False):
                raise ServerError(f"vLLM server {self.urls[index]} could not reset its prefix cache after a sync")
        finally:
            self.call(index, "/resume")

    def reload(self, index: int, weights_path: str) -> None:
        """Server ``index`` loads the checkpoint at ``weights_path`` in place (while ``paused``)."""
        with self.paused(index):
            kwargs = {"weights_path": weights_path, "is_checkpoint_format": True}
            self.call(index, "/collective_rpc", {"method": "reload_weights", "kwargs": kwargs})

    def load_adapter(self, index: int, name: str, path: str) -> None:
        """Server ``index`` loads the LoRA adapter at ``path`` under ``name`` (while ``paused``)."""
        with self.paused(index):
            self.call(index, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, as_json=False)

    def unload_adapter(self, index: int, name: str) -> None:
        """Server ``index`` forgets the LoRA adapter ``name`` (no request may name it afterwards)."""
        self.call(index, "/v1/unload_lora_adapter", {"lora_name": name}, as_json=False)

    def server_info(self, index: int) -> dict[str, Any]:
        """What ``/server_info?config_format=json`` says of server ``index`` (its vLLM config)."""
        try:
            return get(self.urls[index], "/server_info?config_format=json", self.request_timeout)
        except (OSError, ValueError) as error:
            raise ServerError(f"vLLM server {self.urls[index]} failed on /server_info: {describe(error)}") from None

    def tokenize(self, index: int, text: str) -> list[int]:
        """The token ids server ``index``'s tokenizer gives ``text`` (no special tokens added)."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return [int(token) for token in self.call(index, "/tokenize", body)["tokens"]]

    def describe_model(self, index: int) -> dict[str, Any]:
        """What ``/v1/models`` says of the served model (its ``id`` and ``max_model_len``)."""
        try:
            models = get(self.urls[index], "/v1/models", self.request_timeout)["data"]
        except (OSError, ValueError, KeyError) as error:
            raise ServerError(f"vLLM server {self.urls[index]} failed on /v1/models: {describe(error)}") from None
        return models[0]


def completion_request(model: str, prompt: list[int], settings: SamplingSettings, with_logprobs: bool,
                       seed: int) -> dict[str, Any]:  # fmt: skip
    """One ``/v1/completions`` body: exactly ``settings``' distribution, token ids in and out."""
    greedy = settings.temperature == 0
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "n": 1,
        "max_tokens": settings.max_new_tokens,
        "temperature": 0.0 if greedy else settings.temperature,
        "top_p": 1.0 if greedy else settings.top_p,
        "top_k": 0 if greedy or settings.top_k == 0 else settings.top_k,
        "seed": seed,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if with_logprobs:
        body["logprobs"] = 0
        body["return_tokens_as_token_ids"] = True
    return body


def parse_completion(answer: dict[str, Any], with_logprobs: bool, with_routes: bool = False) -> Completion:
    """A ``/v1/completions`` answer as a ``Completion`` (a malformed one is an error naming what is missing; routes
    are checked against their sequence where they are laid out, ``vllm_routes.engine_routes``)."""
    try:
        choice = answer["choices"][0]
        token_ids = [int(token) for token in choice["token_ids"]]
        logprobs = None
        if with_logprobs:
            logprobs = [float(value) for value in choice["logprobs"]["token_logprobs"]]
            if len(logprobs) != len(token_ids):
                raise ValueError(f"{len(logprobs)} log-probs for {len(token_ids)} tokens")
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise ServerError(f"a vLLM server's completion lacks what the engine needs ({error!r})") from None
    routes = decode_routes(choice.get("routed_experts")) if with_routes else None
    return Completion(token_ids, choice.get("finish_reason") == "stop", logprobs, routes)
