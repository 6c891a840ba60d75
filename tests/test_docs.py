"""The README and the documentation site say only what exists: every relative link resolves (anchors included),
every cited repository path and ``gspo_lightning`` name exists, every page is in the site's navigation, the
README stays a short page, and (slow) the site builds in MkDocs' strict mode.

Links from a page to files outside ``docs/`` are not part of the site, so ``docs/`` cites them as paths in code
font (checked here) and never as links; the README may link anything in the repository.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_LINES = 350

PACKAGE_DIRS = ("rollout", "engines", "asynchronous", "objectives", "episodes", "rewards", "data", "models", "moe",
                "sandbox", "callbacks", "metrics")  # fmt: skip
"""Folders of ``gspo_lightning/`` that pages cite by their short path (``rollout/round.py``)."""
ROOTS = ("tests", "gspo_lightning", "configs", "experiments", "docs", ".ci")
NOT_REPO_FILES = {"solution.py"}
"""File names a page cites that are not files of this repository (a sandboxed run's program)."""

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"\bgspo_lightning(?:\.[A-Za-z_]\w*)+")
SEPARATORS = re.compile(r"[\s,()\[\]{}'\"=;]+")


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def documents() -> list[Path]:
    return [README, *pages()]


def code_spans(text: str) -> list[str]:
    """The text of every fenced block and inline code span."""
    fenced = FENCE.findall(text)
    rest = FENCE.sub("", text)
    return fenced + INLINE_CODE.findall(rest)


def slug(heading: str) -> str:
    """A heading's anchor as Python-Markdown's ``toc`` extension (MkDocs' default) makes it."""
    text = re.sub(r"[`*]", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(line.lstrip("#").strip()) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def broken_links(path: Path, text: str) -> list[str]:
    """Relative links in ``text`` (a file at ``path``) whose file, or anchor in a Markdown file, does not exist."""
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        anchor_missing = anchor and resolved.suffix == ".md" and resolved.exists() and anchor not in anchors(resolved)
        if not resolved.exists() or anchor_missing:
            broken.append(target)
    return broken


def cited_paths(text: str) -> list[str]:
    """Repository paths cited in code font: under one of ``ROOTS``, a package folder, or a bare ``*.py`` name."""
    found = []
    for span in code_spans(text):
        for token in SEPARATORS.split(span):
            token = token.split("::")[0].rstrip(".:")
            if "*" in token or "<" in token or not re.fullmatch(r"[\w./-]+", token):
                continue
            top = token.split("/")[0]
            under_root = top in ROOTS and "/" in token
            if under_root or token.endswith(".py") and (top in PACKAGE_DIRS or "/" not in token):
                found.append(token)
    return found


def path_exists(token: str) -> bool:
    if token in NOT_REPO_FILES:
        return True
    if "/" not in token:  # a bare file name: somewhere in the package, the tests or the experiments
        return any(next((ROOT / folder).rglob(token), None) for folder in ("gspo_lightning", "tests", "experiments"))
    if token.split("/")[0] in PACKAGE_DIRS:
        return (ROOT / "gspo_lightning" / token).exists()
    return (ROOT / token).exists()


def missing_paths(text: str) -> list[str]:
    return sorted({token for token in cited_paths(text) if not path_exists(token)})


def module_file(dotted: str) -> Path | None:
    """The source file of module ``dotted`` of this repository, or None when it is not a module."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


def top_level_names(path: Path) -> set[str]:
    """Names a module defines or imports at its top level, and those its ``__getattr__`` still serves."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
            if any(isinstance(t, ast.Name) and t.id.startswith("_MOVED") for t in node.targets):
                names.update(ast.literal_eval(node.value))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def name_exists(dotted: str) -> bool:
    """``gspo_lightning.a.b.Name``: the longest module prefix exists and defines (or imports) the next part."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is not None:
            return cut == len(parts) or parts[cut] in top_level_names(path)
    return False


def missing_names(text: str) -> list[str]:
    cited = {name for span in code_spans(text) for name in DOTTED.findall(span)}
    return sorted(name for name in cited if not name_exists(name))


def nav_pages(nav: list) -> set[str]:
    found: set[str] = set()
    for entry in nav:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            found |= nav_pages(value) if isinstance(value, list) else {value}
    return found


# The checkers themselves, on planted mistakes: each must see what is wrong and pass what is right.


def test_a_planted_broken_path_link_and_name_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A heading\n")
    text = (
        "See `tests/no_such_test.py`, `rollout/no_such_stage.py`, `configs/quickstart.yaml`, `rollout/round.py`,\n"
        "`python experiments/bench/logprobs.py --sections long`, `tests/test_docs.py::test_x`, `runs/<name>/x.csv`.\n"
        "[gone](missing.md), [here](page.md#a-heading), [there](page.md#no-heading), [web](https://example.org)\n"
        "```yaml\nclass_path: gspo_lightning.rewards.ExactAnswer\npolicy: gspo_lightning.models.NoSuchLoader\n```\n"
        "`gspo_lightning.data.WarmStartedTinyQwen3`, `gspo_lightning.models.WarmStartedTinyQwen3` (old path, served)\n"
    )
    assert missing_paths(text) == ["rollout/no_such_stage.py", "tests/no_such_test.py"]
    assert broken_links(page, text) == ["missing.md", "page.md#no-heading"]
    assert missing_names(text) == ["gspo_lightning.models.NoSuchLoader"]


def test_anchors_are_made_as_mkdocs_makes_them():
    assert slug("Held-out evaluation and pass@k") == "held-out-evaluation-and-passk"
    assert slug("Checkpoints and `--ckpt_path last`") == "checkpoints-and-ckpt_path-last"
    assert slug("Where pi_old's log-probs come from") == "where-pi_olds-log-probs-come-from"


# The real tree.


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path, path.read_text()) == []


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_path_exists(path):
    assert missing_paths(path.read_text()) == []


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_gspo_lightning_name_exists(path):
    assert missing_names(path.read_text()) == []


def test_docs_link_no_file_outside_the_site():
    """A link out of ``docs/`` would be broken in the built site: such files are cited in code font instead."""
    outside = [
        (page.name, target)
        for page in pages()
        for target in LINK.findall(page.read_text())
        if not re.match(r"[a-z]+:", target) and DOCS not in (page.parent / target.split("#")[0]).resolve().parents
    ]
    assert outside == []


def test_every_page_is_in_the_navigation():
    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    on_disk = {str(page.relative_to(DOCS)) for page in pages()}
    assert on_disk - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - on_disk == set(), "nav entries without a page"


def test_the_readme_is_a_short_page():
    lines = len(README.read_text().splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; reference material belongs in docs/"


def test_the_readmes_round_picture_is_the_architecture_pages():
    """The picture is drawn twice (the README's reader and the site's); they must not drift apart."""
    picture = re.compile(r"^    PromptDataModule .*?(?=\n\n(?!    ))", re.DOTALL | re.MULTILINE)
    readme, architecture = (picture.search(p.read_text()) for p in (README, DOCS / "architecture.md"))
    assert readme and architecture and readme.group(0) == architecture.group(0)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason='needs pip install -e ".[docs]"')
def test_the_site_builds_in_strict_mode(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "objectives" / "index.html").exists()
