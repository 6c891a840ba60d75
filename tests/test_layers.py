"""The package's layers point one way, and pure math stays pure: read from the source's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gspo_lightning"

# package (or module) -> what it must never import
FORBIDDEN = {
    # rollout: the round's core; the round modes (asynchronous/) and the callbacks (sampling/) sit above it
    "rollout": ("gspo_lightning.data", "gspo_lightning.module", "gspo_lightning.cli", "gspo_lightning.asynchronous",
                "gspo_lightning.sampling"),
    "models": ("gspo_lightning.data", "gspo_lightning.rollout", "gspo_lightning.rewards", "gspo_lightning.module"),
    "data": ("gspo_lightning.module", "gspo_lightning.cli", "gspo_lightning.engines"),
    "engines": ("gspo_lightning.rollout", "gspo_lightning.data", "gspo_lightning.module", "gspo_lightning.models"),
    "rewards": ("gspo_lightning.rollout", "gspo_lightning.data", "gspo_lightning.module", "gspo_lightning.engines"),
    "objectives": ("gspo_lightning.rollout", "gspo_lightning.data", "lightning", "torch.distributed"),
    # episodes: what a round samples with (tools, environments, the turn loop); the round turns them into a Rollout
    "episodes": ("gspo_lightning.rollout", "gspo_lightning.data", "gspo_lightning.module", "gspo_lightning.cli",
                 "lightning"),
    # asynchronous: when a round is sampled and with which weights; the round's stages stay rollout's
    "asynchronous": ("gspo_lightning.data", "gspo_lightning.module", "gspo_lightning.cli", "gspo_lightning.sampling"),
    "sampling": ("gspo_lightning.data", "gspo_lightning.module", "gspo_lightning.cli"),
    "rollout/round.py": ("lightning",),
    "diagnostics.py": ("lightning", "torch.distributed"),
    "logprobs.py": ("lightning", "torch.distributed"),
}


# the imports that point back up: old class paths (the task warm starts, the sampling callbacks), resolved on
# first use
ALLOWED = {("models/__init__.py", "gspo_lightning.data"), ("rollout/__init__.py", "gspo_lightning.sampling")}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_a_layer_does_not_import_what_sits_above_it(part):
    target = PACKAGE / part
    files = sorted(target.rglob("*.py")) if target.is_dir() else [target]
    assert files, part
    found = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in files
        for name in sorted(_imports(path))
        if any(name == banned or name.startswith(banned + ".") for banned in FORBIDDEN[part])
        and (str(path.relative_to(PACKAGE)), name) not in ALLOWED
    ]
    assert found == []


def test_vllms_environment_is_written_in_one_place():
    """Only ``vllm_options.vllm_environment`` writes os.environ among the engines (vLLM reads it when an engine is
    built and caches it per process: two engines setting it on their own would fight over it)."""
    found = set()
    for path in sorted((PACKAGE / "engines").glob("*.py")):
        tree = ast.parse(path.read_text())
        for function in (node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)):
            for node in ast.walk(function):
                call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                writes = call and node.func.attr in ("setdefault", "update", "pop", "__setitem__")
                if (writes or isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)) and "os.environ" in (
                    ast.unparse(node.func.value) if call else ast.unparse(node)
                ):
                    found.add((path.name, function.name))
    assert found == {("vllm_options.py", "vllm_environment")}
