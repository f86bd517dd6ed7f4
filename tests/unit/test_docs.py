"""The documentation points at things that exist: every relative link (and its #anchor)
resolves, every code path it names is in the repository, every ``PIPELINE_*`` variable the
code reads is in docs/configuration.md (and every one the docs name is read), and every queue
and pool field is documented. A rename in the code fails here, naming the page to update."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from pipeline.config.settings import PoolConfig, QueueConfig

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")])
CONFIGURATION = ROOT / "docs" / "configuration.md"

LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)
CODE_PATH = re.compile(r"`((?:pipeline|tasks|tests|bench|deploy|examples|\.ci)/[\w./-]*)`")
VARIABLE = re.compile(r"\bPIPELINE_[A-Z][A-Z0-9_]*[A-Z0-9]\b")
# set by a worker node for its own children, not by a user
INTERNAL_VARIABLES = {"PIPELINE_CONFIG_SNAPSHOT", "PIPELINE_NODE"}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {slug(h) for h in HEADING.findall(text)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_paths_exist(page: Path) -> None:
    missing = [p for p in CODE_PATH.findall(page.read_text()) if not (ROOT / p).exists()]
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def read_variables() -> set[str]:
    found: set[str] = set()
    sources = [*ROOT.joinpath("pipeline").rglob("*.py"), *ROOT.joinpath("tasks").rglob("*.py")]
    tests = [ROOT / "tests" / "conftest.py", ROOT / "tests" / "session_redis.py"]
    for source in [*sources, ROOT / "celeryconfig.py", *tests]:
        found |= set(re.findall(r"[\"'](PIPELINE_[A-Z0-9_]+)[\"']", source.read_text()))
    return found - INTERNAL_VARIABLES


def test_every_variable_the_code_reads_is_documented() -> None:
    documented = set(VARIABLE.findall(CONFIGURATION.read_text()))
    missing = read_variables() - documented
    assert not missing, f"docs/configuration.md does not list {sorted(missing)}"


def test_every_variable_the_docs_name_is_read() -> None:
    named = set().union(*(VARIABLE.findall(page.read_text()) for page in PAGES))
    assert named, "no PIPELINE_* variable found in the docs"
    unknown = named - read_variables()
    assert not unknown, f"the docs name variables nothing reads: {sorted(unknown)}"


@pytest.mark.parametrize("config", [QueueConfig, PoolConfig], ids=lambda c: c.__name__)
def test_every_config_field_is_documented(config: type) -> None:
    text = CONFIGURATION.read_text() + (ROOT / "docs" / "gates.md").read_text()
    missing = [f.name for f in fields(config) if f"`{f.name}`" not in text]
    assert not missing, f"{config.__name__} fields missing from the docs: {missing}"
