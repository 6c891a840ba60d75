"""The user's own reward, tool or environment raising ends the run with one line naming the setting, the function
and the error, then only the user's frames (``GSPO_LIGHTNING_TRACEBACK=1``: every frame).

The fast tests format errors raised through the library's real call paths from a module written to a temporary
folder (a file outside the package, as a user's is); the slow ones run the command line on a tiny config."""

from __future__ import annotations

import concurrent.futures.process
import importlib.util
import os
import pickle
import re
import subprocess
import sys
from concurrent.futures.process import _RemoteTraceback
from pathlib import Path

import pytest
import yaml

from gspo_lightning.cli_errors import LIBRARY_FOLDERS, is_user_file, user_code_report
from gspo_lightning.episodes import EpisodeCodeError, EpisodeError, EpisodeSettings
from gspo_lightning.episodes.tools import calculator
from gspo_lightning.rewards.isolation import RewardRunner
from gspo_lightning.rewards.scoring import RewardFunctionError, score_completions
from gspo_lightning.validation import UserCodeError, user_code_error
from tests.episodes.test_loop import one_round, parts  # noqa: F401 - parts is a fixture
from tests.test_cli import ROOT, tiny_run_config

USER_CODE = '''\
from gspo_lightning.episodes import Environment, Step, ToolCall, ToolCallParser


def score(prompts, completions, **columns):
    return helper(completions)


def helper(completions):
    raise ValueError("bad input")


def lookup(x: int) -> int:
    """Looks x up.

    Args:
        x: a number.
    """
    raise KeyError("no such entry")


class AlwaysCalls(ToolCallParser):
    """Reads a call of lookup out of any turn, so that a random policy calls it."""

    def parse(self, turn):
        return [ToolCall("lookup", {"x": 1}, "lookup(1)")] if "T:" not in turn else []


class Guess(Environment):
    def reset(self, row):
        return [{"role": "user", "content": "1"}]

    def step(self, turn):
        return Step(reward=1.0 / 0.0, done=True)
'''
LIBRARY_FOLDER = str(Path(LIBRARY_FOLDERS[0]))
HEADLINE = "error: sampler.rewards[0] ({module}.score) raised ValueError: bad input"


@pytest.fixture
def user_module(tmp_path):
    """``USER_CODE`` as a module of its own in a temporary folder, importable by name (worker processes too)."""
    name = f"user_code_{tmp_path.name.replace('-', '_')}"
    path = tmp_path / f"{name}.py"
    path.write_text(USER_CODE)
    sys.path.insert(0, str(tmp_path))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(tmp_path))
    del sys.modules[name]


def _reward_error(module, runner=None) -> RewardFunctionError:
    with pytest.raises(RewardFunctionError) as raised:
        score_completions([module.score], [1.0], ["1+1="], ["2"], {}, runner=runner)
    return raised.value


# The frames shown are the user's: the test's own file is outside the package too, so it is left out here.
HERE = (*LIBRARY_FOLDERS, str(Path(__file__).parent))


def test_a_raising_reward_leads_with_its_setting_then_shows_only_the_users_frames(user_module):
    report = user_code_report(_reward_error(user_module, RewardRunner("thread", 30.0)), library=HERE)
    lines = report.splitlines()
    assert lines[0] == HEADLINE.format(module=user_module.__name__)
    assert lines[1] == "  called on 1 completion(s), the first '2' (prompt '1+1=')"
    assert lines[2] == "Traceback of your code (GSPO_LIGHTNING_TRACEBACK=1 shows the whole traceback):"
    path = user_module.__file__
    assert lines[3] == f'  File "{path}", line 5, in score' and lines[-3] == f'  File "{path}", line 9, in helper'
    assert lines[-2].strip() == 'raise ValueError("bad input")' and lines[-1] == "ValueError: bad input"
    assert LIBRARY_FOLDER not in report and "threading.py" not in report


def test_with_the_whole_traceback_the_librarys_frames_appear(user_module):
    error = _reward_error(user_module, RewardRunner("thread", 30.0))
    report = user_code_report(error, full=True, library=HERE)
    assert report.splitlines()[0] == HEADLINE.format(module=user_module.__name__)
    assert f"{LIBRARY_FOLDER}/rewards/isolation.py" in report and f"{LIBRARY_FOLDER}/rewards/scoring.py" in report
    assert "RewardFunctionError" in report.splitlines()[-1]  # the chain, down to the error the run stopped with


def test_the_evaluations_function_is_named_by_its_own_setting(user_module):
    with pytest.raises(RewardFunctionError) as raised:
        score_completions([user_module.score], [1.0], ["1+1="], ["2"], {}, settings=["evaluation.correct"])
    assert raised.value.headline() == f"evaluation.correct ({user_module.__name__}.score) raised ValueError: bad input"


def test_a_wrapped_error_is_found_through_its_cause_and_context(user_module):
    error = _reward_error(user_module)
    try:
        try:
            raise RuntimeError("the trainer stopped") from error
        except RuntimeError:
            raise KeyError("while cleaning up")  # its __context__ is the RuntimeError
    except KeyError as outer:
        assert user_code_error(outer) is error
        assert user_code_report(outer, library=HERE).splitlines()[0] == HEADLINE.format(module=user_module.__name__)
    assert user_code_report(ZeroDivisionError("a bug")) is None  # a bug keeps its traceback


def test_another_rank_says_one_line():
    error = UserCodeError("reward function f raised ...", "sampler.rewards[1]", "pkg.f", OSError("down"))
    assert user_code_report(error, rank=2) == "error: (rank 2) sampler.rewards[1] (pkg.f) raised OSError: down"


def test_an_error_with_no_frame_of_the_users_code_says_so():
    error = UserCodeError("...", "sampler.episodes.tools[0]", "pkg.slow", TimeoutError("did not return"), "episode 0")
    assert user_code_report(error).splitlines() == [
        "error: sampler.episodes.tools[0] (pkg.slow) raised TimeoutError: did not return (episode 0)",
        "(no frame of your code in its traceback; GSPO_LIGHTNING_TRACEBACK=1 shows the whole traceback)",
    ]


def test_a_worker_processs_frames_are_read_from_the_text_it_sent(tmp_path):
    user_file = tmp_path / "scores.py"
    remote = (
        '\n"""\nTraceback (most recent call last):\n'
        f'  File "{concurrent.futures.process.__file__}", line 256, in _process_worker\n'
        "    r = call_item.fn(*call_item.args, **call_item.kwargs)\n"
        f'  File "{user_file}", line 7, in score\n'
        "    return 1 / 0\n"
        'ZeroDivisionError: division by zero\n"""'
    )
    raised = ZeroDivisionError("division by zero")
    raised.__cause__ = _RemoteTraceback(remote)
    error = UserCodeError("...", "sampler.rewards[0]", "scores.score", raised)
    lines = user_code_report(error, library=HERE).splitlines()
    assert lines[1:] == [
        "Traceback of your code (GSPO_LIGHTNING_TRACEBACK=1 shows the whole traceback):",
        f'  File "{user_file}", line 7, in score',
        "    return 1 / 0",
        "ZeroDivisionError: division by zero",
    ]


def test_user_files_are_those_outside_the_package_the_standard_library_and_installed_packages(tmp_path):
    assert is_user_file(str(tmp_path / "my_rewards.py"))
    assert not is_user_file(str(Path(LIBRARY_FOLDER) / "rewards/scoring.py"))
    assert not is_user_file(os.__file__) and not is_user_file(pytest.__file__) and not is_user_file("<frozen runpy>")


def test_the_errors_survive_pickling(user_module):
    error = _reward_error(user_module)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is RewardFunctionError and str(copy) == str(error) and copy.headline() == error.headline()
    episode = EpisodeCodeError("episode 0", "sampler.episodes.environment", "m.Guess.step", KeyError("k"), "episode 0")
    copy = pickle.loads(pickle.dumps(episode))
    assert isinstance(copy, EpisodeError) and copy.headline() == episode.headline()


@pytest.mark.slow
def test_a_reward_raising_in_a_worker_process_shows_the_workers_frames(user_module):
    runner = RewardRunner("process", 120.0)
    try:
        report = user_code_report(_reward_error(user_module, runner), library=HERE)
    finally:
        runner.close()
    assert report.splitlines()[0] == HEADLINE.format(module=user_module.__name__)
    assert f'  File "{user_module.__file__}", line 9, in helper' in report.splitlines()


def test_a_raising_tool_names_its_place_in_the_tools_list(parts, user_module):  # noqa: F811
    respond = lambda context: '<tool_call>{"name": "lookup", "arguments": {"x": 3}}</tool_call>'
    with pytest.raises(EpisodeCodeError) as raised:
        one_round(parts, respond, EpisodeSettings(tools=[calculator, user_module.lookup]))
    assert raised.value.headline() == (
        f"sampler.episodes.tools[1] ({user_module.__name__}.lookup) raised KeyError: 'no such entry' "
        "(episode 0, turn 0)"
    )
    lines = user_code_report(raised.value, library=HERE).splitlines()
    assert lines[1] == '  the call \'{"name": "lookup", "arguments": {"x": 3}}\''
    assert lines[3] == f'  File "{user_module.__file__}", line 18, in lookup'


def test_a_raising_environment_names_the_setting_and_its_method(parts, user_module):  # noqa: F811
    with pytest.raises(EpisodeCodeError) as raised:
        one_round(parts, lambda context: "7", EpisodeSettings(environment=user_module.Guess))
    assert raised.value.headline() == (
        f"sampler.episodes.environment ({user_module.__name__}.Guess.step) raised ZeroDivisionError: float division "
        "by zero (episode 0, turn 0)"
    )
    assert f'  File "{user_module.__file__}", line 33, in step' in user_code_report(raised.value, library=HERE)


def test_an_environment_that_cannot_be_built_names_the_setting(parts):  # noqa: F811
    def refuses():
        raise OSError("no display")

    with pytest.raises(EpisodeCodeError) as raised:
        one_round(parts, lambda context: "7", EpisodeSettings(environment=refuses))
    assert raised.value.setting == "sampler.episodes.environment" and raised.value.function.endswith("refuses")
    assert raised.value.headline().endswith("raised OSError: no display")


# ----- through the command line -----


def _cli_config(tmp_path: Path, module: str, kind: str) -> Path:
    """The tiny run of one step whose reward, tool or environment is ``module``'s."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tiny_run_config(tmp_path, max_steps=1)
    config = yaml.safe_load(path.read_text())
    config["evaluation"]["at_start"] = False
    if kind == "reward":
        config["sampler"]["rewards"] = [f"{module}.score"]
    else:
        tiny = config["model"]["init_args"]["policy"]["init_args"]
        tiny.update(alphabet="0123456789ASTU:\n", chat_template="tools", max_position_embeddings=128)
        config["model"]["init_args"]["max_new_tokens"] = 4
        config["data"]["init_args"]["chat_template"] = True
        tools = {"tools": ["gspo_lightning.episodes.calculator", f"{module}.lookup"],
                 "tool_parser": {"class_path": f"{module}.AlwaysCalls"}}  # fmt: skip
        environment = {"environment": {"class_path": f"{module}.Guess"}}
        config["sampler"]["episodes"] = tools if kind == "tool" else environment
    path.write_text(yaml.safe_dump(config))
    return path


def _fit(config: Path, module_folder: Path, **environment: str) -> subprocess.CompletedProcess:
    variables = dict(os.environ, PYTHONPATH=os.pathsep.join([str(module_folder), str(ROOT)]), **environment)
    if "GSPO_LIGHTNING_TRACEBACK" not in environment:
        variables.pop("GSPO_LIGHTNING_TRACEBACK", None)
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), "--trainer.enable_progress_bar=false"]
    return subprocess.run(command, capture_output=True, text=True, cwd=config.parent, env=variables, timeout=600)


CLI_CASES = [
    ("reward", "sampler.rewards[0] ({m}.score) raised ValueError: bad input", 9),
    # the first episode to end its turn (with EOS) is the first to call
    ("tool", "sampler.episodes.tools[1] ({m}.lookup) raised KeyError: 'no such entry' (episode <n>, turn 0)", 18),
    ("environment", ("sampler.episodes.environment ({m}.Guess.step) raised ZeroDivisionError: float division by "
                     "zero (episode <n>, turn 0)"), 33),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kind, headline, line", CLI_CASES)
def test_the_command_line_leads_with_the_setting_and_shows_the_users_frames(kind, headline, line, tmp_path):
    module = f"user_code_{kind}"
    (tmp_path / f"{module}.py").write_text(USER_CODE)
    result = _fit(_cli_config(tmp_path / "run", module, kind), tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    first = next(number for number, text in enumerate(lines) if text.startswith("error: "))
    assert re.fullmatch(re.escape("error: " + headline.format(m=module)).replace("<n>", r"\d+"), lines[first])
    assert not any("Traceback" in text or "File " in text for text in lines[:first])  # it leads
    assert f'  File "{tmp_path / module}.py", line {line}, in' in "\n".join(lines)
    assert "gspo_lightning/" not in result.stderr and "lightning/pytorch" not in result.stderr
    assert len(lines) < 25
    full = _fit(_cli_config(tmp_path / "full", module, kind), tmp_path, GSPO_LIGHTNING_TRACEBACK="1")
    assert full.returncode == 1 and lines[first] in full.stderr.splitlines()  # the same episode: the same seed
    assert "lightning/pytorch/trainer/trainer.py" in full.stderr and "gspo_lightning/cli.py" in full.stderr
