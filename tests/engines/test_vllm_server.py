"""``VLLMServerEngine`` and its client against fake vLLM servers on localhost (``fake_vllm_server.py``): the order of
a round's results whatever the servers' timing, groups spread over the servers, retries and failover, one-line
errors naming the server, malformed answers, the fit-start checks and the settings. The real ``vllm serve`` runs in
``test_vllm_server_cli.py`` (slow)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from gspo_lightning.engines import ENGINES, VLLMServerEngine, resolve_engine
from gspo_lightning.engines.base import SamplingSettings
from gspo_lightning.engines.server_client import Servers, ServerError, completion_request
from gspo_lightning.engines.server_launch import require_free, serve_command
from gspo_lightning.engines.vllm_server import rank_servers
from tests.engines.fake_vllm_server import Behaviour, FakeVLLMServer, fake_ids, fake_tokens

SETTINGS = SamplingSettings(max_new_tokens=3, temperature=1.0)


@pytest.fixture
def servers():
    started: list[FakeVLLMServer] = []

    def start(*behaviours: Behaviour) -> list[FakeVLLMServer]:
        started.extend(FakeVLLMServer(behaviour) for behaviour in behaviours)
        return started

    yield start
    for server in started:
        server.stop()


def _completions(fakes: list[FakeVLLMServer]) -> list[dict]:
    return [body for fake in fakes for path, body in fake.behaviour.requests if path == "/v1/completions"]


def test_a_rounds_results_keep_their_rows_whatever_the_servers_timing(servers):
    fakes = servers(Behaviour(max_delay=0.05), Behaviour(max_delay=0.05))
    client = Servers([fake.url for fake in fakes], request_timeout=5, retry_seconds=5, model="policy")
    prompts = [[3, 4], [5], [6, 7, 8], [9]]
    completions = client.complete(prompts, SETTINGS, group_size=3, with_logprobs=True, seed=100)
    assert [c.token_ids for c in completions] == [fake_tokens(p, 100 + 3 * i + g) for i, p in enumerate(prompts)
                                                  for g in range(3)]  # fmt: skip
    assert [c.ended for c in completions] == [(100 + row) % 2 == 1 for row in range(12)]
    assert completions[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    # group i on server i % 2: a prompt's G requests share one server's prefix cache
    assert sorted(tuple(body["prompt"]) for body in _completions(fakes[:1])) == sorted([(3, 4)] * 3 + [(6, 7, 8)] * 3)
    assert sorted(tuple(body["prompt"]) for body in _completions(fakes[1:])) == sorted([(5,)] * 3 + [(9,)] * 3)


def test_each_servers_requests_latency_tokens_and_queue_are_counted_until_taken(servers):
    fakes = servers(Behaviour(), Behaviour())
    client = Servers([fake.url for fake in fakes], request_timeout=5, retry_seconds=5, model="policy")
    client.complete([[1], [2], [3]], SETTINGS, group_size=2, with_logprobs=False, seed=0)
    fakes[1].stop()
    figures = client.take_figures()
    assert (figures["server0/requests"], figures["server1/requests"]) == (4, 2)  # prompts 0 and 2 on server 0
    assert figures["server0/tokens_per_s"] == pytest.approx(2 * figures["server1/tokens_per_s"])  # 3 tokens each
    assert figures["server0/latency_s"] > 0 and figures["server0/queue_depth"] == 5.0  # running 2 + waiting 3
    assert figures["server1/queue_depth"] != figures["server1/queue_depth"]  # NaN: it stopped answering
    again = client.take_figures()
    assert again["server0/requests"] == 0 and again["server0/tokens_per_s"] == 0.0 and set(again) == set(figures)


def test_requests_carry_token_ids_and_exactly_the_settings_distribution():
    body = completion_request("policy", [1, 2], SamplingSettings(4, temperature=0.7, top_p=0.9, top_k=5), True, 11)
    assert body["prompt"] == [1, 2] and body["return_token_ids"] and body["seed"] == 11
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (0.7, 0.9, 5, 4)
    assert body["logprobs"] == 0
    greedy = completion_request("policy", [1], SamplingSettings(4, temperature=0.0, top_p=0.5, top_k=3), False, 0)
    assert (greedy["temperature"], greedy["top_p"], greedy["top_k"]) == (0.0, 1.0, 0) and "logprobs" not in greedy


def test_a_failing_server_is_retried_and_its_requests_fail_over(servers):
    fakes = servers(Behaviour(fail=-1), Behaviour())
    client = Servers([fake.url for fake in fakes], request_timeout=5, retry_seconds=10, model="policy")
    completions = client.complete([[1], [2]], SETTINGS, group_size=2, with_logprobs=False, seed=0)
    assert [c.token_ids for c in completions] == [fake_tokens([1], 0), fake_tokens([1], 1), fake_tokens([2], 2),
                                                  fake_tokens([2], 3)]  # fmt: skip
    assert len(_completions(fakes[1:])) == 4  # all answered by the healthy server


def test_a_server_that_recovers_within_the_budget_finishes_the_round(servers):
    (fake,) = servers(Behaviour(fail=2))
    client = Servers([fake.url], request_timeout=5, retry_seconds=10, model="policy")
    assert client.complete([[1]], SETTINGS, group_size=1, with_logprobs=False, seed=0)[0].token_ids == fake_tokens(
        [1], 0
    )


def test_a_server_failing_past_the_budget_stops_with_one_line_naming_it_and_what_it_said(servers):
    (fake,) = servers(Behaviour(fail=-1))
    client = Servers([fake.url], request_timeout=5, retry_seconds=0.5, model="policy")
    started = time.monotonic()
    with pytest.raises(ServerError) as caught:
        client.complete([[1]], SETTINGS, group_size=1, with_logprobs=False, seed=0)
    message = str(caught.value)
    assert "\n" not in message and time.monotonic() - started < 5
    assert message.startswith(f"vLLM server {fake.url} failed on /v1/completions: HTTP 500")
    assert "engine core died" in message and "sampler.engine.retry_seconds" in message


def test_a_dead_server_is_named_with_no_answer(servers):
    (fake,) = servers(Behaviour())
    fake.stop()
    client = Servers([fake.url], request_timeout=1, retry_seconds=0.3, model="policy")
    with pytest.raises(ServerError, match=rf"vLLM server {fake.url} failed on /pause\?mode=wait: no answer"):
        client.reload(0, "/weights")


def test_a_completion_without_token_ids_is_refused_naming_what_is_missing(servers):
    (fake,) = servers(Behaviour(malformed=True))
    client = Servers([fake.url], request_timeout=5, retry_seconds=1, model="policy")
    with pytest.raises(ServerError, match="completion lacks what the engine needs.*token_ids"):
        client.complete([[1]], SETTINGS, group_size=1, with_logprobs=False, seed=0)


def test_a_sync_pauses_reloads_resets_the_prefix_cache_and_resumes_in_that_order(servers):
    (fake,) = servers(Behaviour())
    Servers([fake.url], request_timeout=5, retry_seconds=1, model="policy").reload(0, "/dev/shm/step_3")
    assert fake.paths() == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    rpc = fake.behaviour.requests[1][1]
    assert rpc == {"method": "reload_weights", "kwargs": {"weights_path": "/dev/shm/step_3",
                                                         "is_checkpoint_format": True}}  # fmt: skip


def test_a_failed_reload_still_resumes_generation(servers):
    (fake,) = servers(Behaviour(fail_paths={"/collective_rpc"}))
    client = Servers([fake.url], request_timeout=5, retry_seconds=0.3, model="policy")
    with pytest.raises(ServerError, match="/collective_rpc"):
        client.reload(0, "/weights")
    assert fake.paths()[-1] == "/resume"


def test_probe_log_probs_are_read_per_token(servers):
    (fake,) = servers(Behaviour())
    client = Servers([fake.url], request_timeout=5, retry_seconds=1, model="policy")
    assert client.prompt_logprobs(0, [5, 6, 7]) == [-0.5, -0.5]


def _engine_on(fakes: list[FakeVLLMServer], **settings) -> VLLMServerEngine:
    engine = VLLMServerEngine(urls=[fake.url for fake in fakes], retry_seconds=1, **settings)
    engine.client = Servers(engine.urls, 5, 1, engine.model or "policy")
    return engine


def _policy(max_positions: int) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(max_position_embeddings=max_positions))


def _tokenizer(text: str, add_special_tokens: bool) -> dict:
    return {"input_ids": fake_ids(text)}


def test_a_server_with_another_model_is_refused_at_fit_start_naming_both(servers):
    fakes = servers(Behaviour(), Behaviour(model="Qwen/Qwen3-8B"))
    with pytest.raises(ValueError, match=r"serves 'Qwen/Qwen3-8B', but sampler.engine.model is 'policy'"):
        _engine_on(fakes, model="policy")._check_servers(_policy(512), _tokenizer)


def test_a_server_with_a_shorter_context_is_refused_at_fit_start_naming_both(servers):
    fakes = servers(Behaviour(max_model_len=256))
    with pytest.raises(ValueError, match=r"context length 256, the policy 512: start it with --max-model-len 512"):
        _engine_on(fakes)._check_servers(_policy(512), _tokenizer)


def test_a_server_with_another_vocabulary_is_refused_at_fit_start_naming_both(servers):
    fakes = servers(Behaviour(vocabulary=40))
    with pytest.raises(ValueError, match=r"tokenizes 'GSPO.* as \[.*\], the policy's tokenizer as \[.*another vocab"):
        _engine_on(fakes)._check_servers(_policy(512), _tokenizer)


def test_servers_of_the_policys_model_pass_the_fit_start_checks(servers):
    _engine_on(servers(Behaviour(), Behaviour()))._check_servers(_policy(512), _tokenizer)


def test_samples_come_back_padded_in_row_order_with_their_log_probs(servers):
    fakes = servers(Behaviour(max_delay=0.02), Behaviour(max_delay=0.02))
    engine = _engine_on(fakes)
    engine.loaded = object()  # weights synced (the sync itself runs against real servers, in the slow test)
    prompt_ids = torch.tensor([[0, 3, 4], [6, 7, 8]])  # left-padded
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    samples = engine.sample(None, SimpleNamespace(pad_token_id=0), prompt_ids, prompt_mask, SETTINGS, 2,
                            with_logprobs=True, seed=4)  # fmt: skip
    expected = [fake_tokens([3, 4], 4), fake_tokens([3, 4], 5), fake_tokens([6, 7, 8], 6), fake_tokens([6, 7, 8], 7)]
    assert samples.response_ids.tolist() == expected
    assert samples.ended.tolist() == [False, True, False, True]
    assert torch.allclose(samples.logprobs, torch.tensor([[-0.1, -0.2, -0.3]] * 4))


def test_each_training_rank_gets_servers_of_its_own():
    urls = ["http://a:1", "http://b:1", "http://c:1", "http://d:1"]
    assert rank_servers(urls, 0, 2) == ["http://a:1", "http://c:1"]
    assert rank_servers(urls, 1, 2) == ["http://b:1", "http://d:1"]
    for count in (1, 3):
        with pytest.raises(ValueError, match=f"lists {count} servers for 2 training ranks"):
            rank_servers(urls[:count], 0, 2)


def test_a_taken_port_is_refused_before_a_server_is_started(servers):
    (fake,) = servers(Behaviour())
    port = int(fake.url.rsplit(":", 1)[1])
    with pytest.raises(ValueError, match=rf"sampler.engine.port .*: port {port} on 127.0.0.1 is taken"):
        require_free(port, "sampler.engine.port (8100, server 0 on 8100 + 0)")
    require_free(0, "sampler.engine.port")  # any free port passes


def test_the_started_servers_command_carries_the_engines_arguments():
    command = serve_command({"model": "/weights", "dtype": "float32", "enforce_eager": True,
                             "enable_chunked_prefill": False, "max_model_len": 512}, port=8123)  # fmt: skip
    assert "/weights" in command and command[command.index("--port") + 1] == "8123"
    assert "--enforce-eager" in command and "--no-enable-chunked-prefill" in command
    assert command[command.index("--max-model-len") + 1] == "512"


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"urls": []}, "sampler.engine.urls must be a non-empty list of http"),
        ({"urls": ["node7:8000"]}, "sampler.engine.urls must be a non-empty list of http"),
        ({"servers": 0}, "sampler.engine.servers must be >= 1"),
        ({"servers": 2, "cpu_cores": ["1"]}, r"sampler.engine.cpu_cores needs one entry per server \(2\)"),
        ({"devices": ["1", "2"]}, r"sampler.engine.devices needs one entry per server \(1\)"),
        ({"retry_seconds": 0}, "sampler.engine.retry_seconds must be > 0"),
        ({"port": 70000}, "sampler.engine.port must be a free port number"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        VLLMServerEngine(**settings)


def test_the_engine_is_registered_by_name():
    assert ENGINES["vllm_server"] is VLLMServerEngine
    assert isinstance(resolve_engine("vllm_server"), VLLMServerEngine)
