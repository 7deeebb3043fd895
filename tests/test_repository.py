"""The repository tracks sources only: build artefacts are ignored (.gitignore), and this check
fails CI when one is committed anyway (``git add -f``, or a .gitignore that lost a line). The
recorded benchmark results hold results, not scripts, the docs' relative links resolve, and the
README's quickstart says what its tox commands install."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Paths a build, an install or a test run leaves behind.
ARTEFACT = re.compile(
    r"(^|/)(__pycache__|build|dist|\.tox|\.eggs|[^/]+\.egg-info)(/|$)|\.py[cod]$|\.whl$"
)


def tracked_files() -> list[str]:
    """Every path git tracks under the repository root; skips outside a git checkout."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    run = subprocess.run(
        [git, "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True, check=False
    )
    if run.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout: {run.stderr.strip()}")
    return [path for path in run.stdout.split("\0") if path]


def test_no_build_artefact_is_tracked():
    tracked = [path for path in tracked_files() if ARTEFACT.search(path)]
    assert not tracked, "build artefacts are tracked (git rm -r --cached them):\n" + "\n".join(
        tracked[:20]
    )


ARTEFACTS = ["graphcap.egg-info/PKG-INFO", "build/lib/graphcap/__init__.py", ".tox/cpu/log"]
ARTEFACTS += ["dist/graphcap-0.1.0.whl", "graphcap/__pycache__/cli.cpython-312.pyc"]


@pytest.mark.parametrize("path", ARTEFACTS)
def test_the_check_recognises_artefacts(path):
    assert ARTEFACT.search(path)


@pytest.mark.parametrize("path", ["graphcap/bench/run.py", "docs/build-notes.md", "tests/dist.py"])
def test_the_check_leaves_sources_alone(path):
    assert not ARTEFACT.search(path)


def test_gitignore_covers_the_artefacts():
    ignored = (ROOT / ".gitignore").read_text().split()
    assert {
        "__pycache__/",
        "*.py[cod]",
        "*.egg-info/",
        ".eggs/",
        "build/",
        "dist/",
        ".tox/",
    } <= set(ignored)


def test_the_readmes_quickstart_says_what_its_tox_environments_install():
    """The torch the README names is the one tox.ini pins; pip picks its build (the README
    says how to get the CPU one) and the first install prints nothing for minutes (it says so)."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    readme = (ROOT / "README.md").read_text()
    for env in ("bench", "cpu"):
        assert f"tox -e {env}" in readme or f"tox -e {env}," in readme
        pins = re.findall(r"^torch==(\d+\.\d+)", tox[f"testenv:{env}"]["deps"], re.MULTILINE)
        assert pins and f"torch {pins[0]}" in readme, (env, pins)
    assert "CPU build of torch" not in readme  # pip's index decides the build
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in readme
    assert "tox -v -e bench" in readme and "install_deps>" in readme


def test_the_results_folder_holds_results_only():
    scripts = [
        path
        for path in tracked_files()
        if path.startswith("benchmarks/results/") and path.endswith((".py", ".sh"))
    ]
    assert not scripts, (
        "scripts under benchmarks/results/ (make them part of the suite, benchmarks/*.py "
        "documented in benchmarks/README.md, or remove them):\n" + "\n".join(scripts)
    )


#: A Markdown link's target: a path (empty: this file) and an optional heading anchor.
LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces
    as hyphens."""
    titles = [line.lstrip("#").strip() for line in page.read_text().splitlines() if line[:1] == "#"]
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for title in titles}


def test_relative_links_in_the_docs_resolve():
    broken = []
    for name in (path for path in tracked_files() if path.endswith(".md")):
        page = ROOT / name
        for target, anchor in LINK.findall(page.read_text()):
            if target.startswith(("http:", "https:", "mailto:")):
                continue
            linked = (page.parent / target).resolve() if target else page
            if not linked.exists():
                broken.append(f"{name}: {target} does not exist")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{name}: {target or name}#{anchor} names no heading")
    assert not broken, "broken links in the docs:\n" + "\n".join(broken)
