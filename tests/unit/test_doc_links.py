"""Every relative link in README.md and docs/ resolves, and every script the docs name exists.

Links go stale when a page's heading or a results file is renamed, and a doc that names a deleted
script tells a user to run something that is not there; both were found by hand before.
"""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
# docs/results holds raw outputs as measured, not pages a reader navigates.
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.parts)]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SCRIPT = re.compile(r"\bscripts/[A-Za-z0-9_./-]+\.(?:py|sh|md)\b")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set:
    return {_anchor(line) for line in page.read_text().splitlines() if line.startswith("#")}


def _code_free(text: str) -> str:
    """The page without its fenced code blocks (a shell comment is not a heading or a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_the_anchor_rule_matches_githubs():
    assert _anchor("### Fastest settings") == "fastest-settings"
    assert _anchor("## Fused linear + cross-entropy vs peer kernels") == "fused-linear--cross-entropy-vs-peer-kernels"
    assert _anchor("### Tried, and did not pay") == "tried-and-did-not-pay"


def test_the_pages_were_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/benchmarks.md", "docs/recipes.md"} <= names and len(names) >= 15


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(_code_free(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path) if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_script_named_exists(page):
    missing = sorted({s for s in SCRIPT.findall(page.read_text()) if not (ROOT / s).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names scripts that do not exist: {missing}"
