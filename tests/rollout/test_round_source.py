"""The sampler picks one round source per mode and never looks at the mode again."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gspo_lightning.asynchronous import AsyncRollouts
from gspo_lightning.asynchronous.rounds import FixedLagRounds, StreamingRounds
from gspo_lightning.engines import HFEngine
from gspo_lightning.rollout.source import OnPolicyRounds, RoundSource
from gspo_lightning.sampling.sampler import round_source

SAMPLER = Path(__file__).resolve().parents[2] / "gspo_lightning" / "sampling" / "sampler.py"


@pytest.mark.parametrize(
    ("settings", "kind"),
    [(AsyncRollouts(), OnPolicyRounds), (AsyncRollouts(mode="fixed_lag", lag=2), FixedLagRounds),
     (AsyncRollouts(mode="streaming"), StreamingRounds)],
)  # fmt: skip
def test_each_mode_has_its_source_and_every_source_is_a_round_source(settings, kind):
    source = round_source(settings, HFEngine())
    assert type(source) is kind
    assert isinstance(source, RoundSource)
    assert set(source.seconds_logged) <= {"trainer_wait_s", "engine_idle_s"}


def test_on_policy_keeps_nothing_for_resume_and_lends_the_engine_freely():
    source = OnPolicyRounds(HFEngine())
    assert source.state_dict() is None
    with source.lend():
        pass
    source.close()


def test_the_sampler_reads_the_mode_only_to_pick_its_source_and_to_fix_it_for_resume():
    tree = ast.parse(SAMPLER.read_text())
    readers = {
        function.name
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute) and node.attr == "mode" and "asynchronous" in ast.unparse(node.value)
        or isinstance(node, ast.Attribute) and node.attr == "mode" and ast.unparse(node.value) == "settings"
    }
    assert readers == {"round_source", "_fixed_settings"}
