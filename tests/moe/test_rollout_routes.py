"""Rollout Routing Replay (R3): the hf engine records the experts of its own generate forwards, they travel with
the rollout, and the trainer's forwards replay them; exactly, under every layout."""

from __future__ import annotations

import pytest
import torch

from gspo_lightning.engines import HFEngine, VLLMEngine
from gspo_lightning.episodes import EpisodeSettings
from gspo_lightning.micro_batches import BatchLayout
from gspo_lightning.models import TinyQwen3Moe
from gspo_lightning.module import GSPOModule
from gspo_lightning.moe.rollout_routes import RouteLayoutError, first_read, joined_routes, rollout_routes
from gspo_lightning.moe.routing import NOT_RECORDED, find_routers
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rollout.checks import check_routing_replay
from gspo_lightning.rollout.pipeline import Scoring
from gspo_lightning.rollout.round import RoundModel, RoundSettings, run_round
from gspo_lightning.rollout.types import PromptBatch
from gspo_lightning.validation import SettingError
from tests.episodes.envs import COUNTING_ALPHABET, Counting
from tests.episodes.scripted import TOOL_TINY

MOE = dict({k: v for k, v in TOOL_TINY.items() if k != "chat_template"}, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32)  # fmt: skip
PROMPTS = PromptBatch(["1+1=", "123+456=", "7", "12*34="], {"answer": ["2", "579", "7", "408"]})
GROUP = 3
LAYOUTS = {"padded": BatchLayout(), "packed": BatchLayout(packing=True), "budget": BatchLayout(micro_batch_tokens=48)}


def _sharp_moe(**overrides):
    loader = TinyQwen3Moe(**(MOE | overrides))
    tokenizer = loader.load_tokenizer()
    tokenizer.chat_template = TOOL_TINY["chat_template"]  # the episodes' template
    policy = loader.load_model(tokenizer).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # large random weights: routing that differs by token
        for parameter in policy.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.3, generator=generator)
    return policy, tokenizer


@pytest.fixture(scope="module")
def moe():
    return _sharp_moe()


def _round(moe, engine, replay="off", layout=BatchLayout(), episodes=None, minibatches=2, logprobs=False):
    policy, tokenizer = moe
    settings = RoundSettings(group_size=GROUP, num_minibatches=minibatches, episodes=episodes,
                             scoring=Scoring([ExactAnswer()], [1.0]))  # fmt: skip
    model = RoundModel(policy, tokenizer, max_new_tokens=10, engine_routes=True, routing_replay=replay, layout=layout,
                       engine_logprobs=logprobs)  # fmt: skip
    torch.manual_seed(0)
    return run_round(engine, model, settings, PROMPTS, seed=0)


def _recorded_in(minibatch, rollout, rows):
    """The rollout's recorded routes over the minibatch's trimmed columns."""
    width, length = rollout.prompt_ids.shape[1], minibatch.input_ids.shape[1]
    prompt = length - minibatch.response_ids.shape[1]
    return rollout.routes[rows, :, width - prompt : width - prompt + length]  # [n, layers, L, k]


def _check_exact(result, policy):
    rollout = result.rollout
    layers, k = len(find_routers(policy)), 2
    columns = rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1]
    assert rollout.routes.shape == (len(rollout), layers, columns, k)
    start = 0
    for minibatch in result.minibatches:
        rows = slice(start, start + len(minibatch))
        start += len(minibatch)
        recorded = _recorded_in(minibatch, rollout, rows)  # [n, layers, L, k]
        real = minibatch.attention_mask.bool()  # [n, L]
        has = recorded[:, 0, :, 0] != NOT_RECORDED  # [n, L]
        # every real token but each row's last is recorded (the last is read only when the batch went on past
        # it: an EOS while other rows continued); no padding is
        last = real.long().cumsum(-1).argmax(-1)  # [n] column of each row's last real token
        expected = real.clone()
        expected[torch.arange(len(last)), last] = False
        assert (has >= expected).all() and not (has & ~real).any()
        # the sampler's experts are pi_old's, token for token, and the diagnostic says so exactly
        old = minibatch.old_routes  # [n, layers, L, k]
        assert torch.equal(recorded.permute(0, 2, 1, 3)[expected], old.permute(0, 2, 1, 3)[expected].to(recorded.dtype))
        assert torch.equal(minibatch.rollout_route_change, torch.zeros(layers))


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("replay", ["off", "rollout"])
def test_hf_engine_records_pi_olds_experts_token_for_token(moe, layout, share, replay):
    result = _round(moe, HFEngine(share_prompt_prefill=share), replay, LAYOUTS[layout])
    assert not result.rollout.prompt_mask.all()  # prompts of different lengths: left padding is exercised
    _check_exact(result, moe[0])


def test_episodes_record_each_token_from_the_forward_that_first_read_it():
    counting = _sharp_moe(alphabet=COUNTING_ALPHABET)  # few characters: turns end with EOS within a few tokens
    episodes = EpisodeSettings(environment=lambda: Counting(turns=2), max_turns=2)
    result = _round(counting, HFEngine(), "rollout", LAYOUTS["packed"], episodes=episodes)
    assert (result.rollout.episodes.turns == 2).any() and (result.rollout.episodes.context_tokens > 0).any()
    _check_exact(result, counting[0])


def test_a_bfloat16_sampler_routes_differently_and_r3_replays_its_experts():
    wide = _sharp_moe(num_experts=32, num_experts_per_tok=4)  # more experts: closer calls for bf16 to flip
    engine = HFEngine(sampling_dtype="bfloat16")
    plain = _round(wide, engine, "off", minibatches=1, logprobs=True)
    replayed = _round(wide, engine, "rollout", minibatches=1, logprobs=True)
    assert torch.equal(plain.rollout.response_ids, replayed.rollout.response_ids)  # the same samples
    assert plain.minibatches[0].rollout_route_change.mean() > 0  # bf16 rounding moved some experts
    for result, forced in ((plain, False), (replayed, True)):
        minibatch = result.minibatches[0]
        recorded = _recorded_in(minibatch, result.rollout, slice(None))  # [n, layers, L, k]
        has = (recorded[:, 0, :, 0] != NOT_RECORDED) & minibatch.attention_mask.bool()  # [n, L]
        old = minibatch.old_routes.permute(0, 2, 1, 3)[has].to(recorded.dtype)  # [tokens, layers, k]
        same = torch.equal(recorded.permute(0, 2, 1, 3)[has], old)
        assert same == forced  # R3's pi_old ran on the sampler's experts; without it, on its own


def test_routes_that_do_not_fit_the_sequence_are_refused_naming_both_shapes(moe):
    class ShortRoutes(HFEngine):
        def sample(self, *args, **kwargs):
            samples = super().sample(*args, **kwargs)
            samples.routes = samples.routes[:, :, :-1]  # one column short
            return samples

    class FewerLayers(HFEngine):
        def sample(self, *args, **kwargs):
            samples = super().sample(*args, **kwargs)
            samples.routes = samples.routes[:, 1:]  # one layer short
            return samples

    with pytest.raises(RouteLayoutError, match=r"reported routed experts over 7 context and 10 response columns"):
        _round(moe, ShortRoutes(), "rollout")
    with pytest.raises(RouteLayoutError, match=r"routed experts of shape \(6, 1, 18, 2\) .* through 2 MoE layers"):
        _round(moe, FewerLayers(), "rollout")


def test_r3_with_an_engine_that_cannot_record_is_refused_at_setup_naming_it():
    cpu = torch.device("cpu")
    check_routing_replay("rollout", "engine", HFEngine(), cpu)
    with pytest.raises(SettingError, match=r"routing_replay: rollout needs .*sampler.engine: vllm does not: vLLM 0.32"):
        check_routing_replay("rollout", "recompute", VLLMEngine(), cpu)  # the GPU side: tests/engines/test_vllm_routes
    with pytest.raises(SettingError, match="routing_replay: old needs sampler.old_logprobs: recompute"):
        check_routing_replay("old", "engine", HFEngine(), cpu)


def test_r3_training_step_replays_the_samplers_experts(moe):
    module = GSPOModule(TinyQwen3Moe(**MOE), objective="grpo", routing_replay="rollout")
    module.configure_model()
    module.policy.load_state_dict(moe[0].state_dict())
    minibatch = _round((module.policy, module.tokenizer), HFEngine(), "rollout", minibatches=1).minibatches[0]
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    module.log_dict = lambda values, **kwargs: logged.update(values)
    module.training_step(PromptBatch(PROMPTS.prompts, PROMPTS.columns, minibatch=minibatch), 0).backward()
    assert logged["train/ratio_mean"] == 1.0 and logged["moe/expert_change_frac"] == 0.0
    assert logged["moe/rollout_vs_old_change_frac"] == 0.0 and "moe/rollout_vs_old_change_frac_layer1" in logged
    assert all(router.weight.grad is not None for router in find_routers(module.policy))
    module.on_train_batch_end(None, None, 0)


# --- the pure functions, on hand-written routes -------------------------------------------------------------------

R = NOT_RECORDED


def test_first_read_keeps_what_was_recorded_and_fills_the_rest():
    known = torch.tensor([[[1, 2], [3, 4], [R, R]]])  # [1 layer, 3 tokens, k=2]: the last one never read
    new = torch.tensor([[[7, 7], [7, 7], [5, 6], [0, 1]]])  # a later prefill read them all, and one more
    assert first_read(known, new).tolist() == [[[1, 2], [3, 4], [5, 6], [0, 1]]]
    assert torch.equal(first_read(None, new), new)
    with pytest.raises(RouteLayoutError, match="cannot extend"):
        first_read(new, known)


def test_rollout_layout_pads_prompts_left_and_responses_right():
    rows = [torch.tensor([[[1, 1], [2, 2], [3, 3]]]), torch.tensor([[[4, 4]]])]  # 3 and 1 tokens recorded
    routes = rollout_routes(rows, prompt_lengths=[2, 1], prompt_width=3, response_width=2)  # [2, 1, 5, 2]
    assert routes[:, 0, :, 0].tolist() == [[R, 1, 2, 3, R], [R, R, 4, R, R]]


def test_joined_routes_align_prompts_and_responses_of_rollouts_of_different_widths():
    first = torch.tensor([[[[1, 1], [2, 2], [3, 3]]]])  # [1, 1, Lp=2 + R=1, 2]
    second = torch.tensor([[[[4, 4], [5, 5], [6, 6]]]])  # [1, 1, Lp=1 + R=2, 2]
    joined = joined_routes([(first, 2), (second, 1)], prompt_width=2, response_width=2)  # [2, 1, 4, 2]
    assert joined[:, 0, :, 0].tolist() == [[1, 2, 3, R], [R, 4, 5, 6]]
