"""Each recipe's page (docs/recipes/<recipe>.md) lists exactly the top-level keys it reads.

The page says "The N top-level keys the recipe reads (its `CONFIG_KEYS`)" above a table whose
first column names them in backticks (a row may name two, e.g. `save_every_n_steps`,
`keep_last_n_checkpoints`). N must be len(CONFIG_KEYS), every key must have a row, and no row
may name a key the recipe does not read: the tables had drifted as recipes gained keys.
CONFIG_KEYS is read without importing the script, as `tune` does (registry.recipe_config_keys).
"""

import re
from pathlib import Path

import pytest

from tune_recipes._cli import registry

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
DOCS = ROOT / "docs" / "recipes"
HEADING = re.compile(r"The (\d+) top-level keys the recipe reads \(its `CONFIG_KEYS`\)")
TABLE_ANCHOR = "top-level keys the recipe reads (its `CONFIG_KEYS`)"


def _recipes_with_keys():
    found = {}
    for path in sorted(RECIPES.glob("*.py")):
        keys = registry.recipe_config_keys(path)
        if keys is not None and not path.name.startswith("_"):
            found[path.stem] = keys
    return found


RECIPE_KEYS = _recipes_with_keys()


def _key_table(text: str):
    """(stated count or None, {key: row}) for the first table after the CONFIG_KEYS sentence."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if TABLE_ANCHOR in line), None)
    assert start is not None, f"no line saying {TABLE_ANCHOR!r}"
    m = HEADING.search(" ".join(lines[start:start + 2]))
    i = start
    while i < len(lines) and not lines[i].startswith("|"):
        i += 1
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        rows.append(lines[i])
        i += 1
    assert len(rows) > 2 and rows[0].split("|")[1].strip() == "key", rows[:2]
    named = {}
    for row in rows[2:]:  # after the header and the |---| line
        first_cell = row.split("|")[1]
        for key in re.findall(r"`([^`]+)`", first_cell):
            assert key not in named, f"{key} has two rows"
            named[key] = row
    return (int(m.group(1)) if m else None), named


def test_every_recipe_with_config_keys_has_a_page_and_every_key_page_a_recipe():
    assert len(RECIPE_KEYS) >= 10, sorted(RECIPE_KEYS)  # the glob found the recipes
    pages = {p.stem for p in DOCS.glob("*.md") if TABLE_ANCHOR in p.read_text()}
    assert pages == set(RECIPE_KEYS)


@pytest.mark.parametrize("recipe", sorted(RECIPE_KEYS))
def test_the_pages_key_table_matches_config_keys(recipe):
    keys = RECIPE_KEYS[recipe]
    count, named = _key_table((DOCS / f"{recipe}.md").read_text())
    missing = sorted(keys - set(named))
    extra = sorted(set(named) - keys)
    assert (count, missing, extra) == (len(keys), [], []), (
        f"docs/recipes/{recipe}.md: says {count} keys, CONFIG_KEYS has {len(keys)}; "
        f"no row for {missing}; rows for keys the recipe does not read: {extra}")
