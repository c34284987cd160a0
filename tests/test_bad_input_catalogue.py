"""One test per row of the bad-input catalogue (scripts/bad_inputs.py), asserting the
exception type and message, plus a check that the table in docs/bad-inputs.md is
what the rows raise today (scripts/gen_bad_input_table.py renders it)."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter
from pathlib import Path

import pytest
from bad_inputs import AREAS, CASES, BadInput, normalise, provoke

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_documented_message(case: BadInput, tmp_path: Path) -> None:
    exc_type, raw = provoke(case, tmp_path)
    if case.kind == "raises":
        assert exc_type is not None and issubclass(exc_type, case.exc)
    message = normalise(case, raw, tmp_path)
    assert re.search(case.match, message, flags=re.DOTALL), (
        f"{case.id}: message does not match {case.match!r}:\n{message}"
    )


def test_catalogue_is_well_formed() -> None:
    ids = Counter(c.id for c in CASES)
    assert not [i for i, n in ids.items() if n > 1], "duplicate catalogue ids"
    assert all(c.area in AREAS for c in CASES)
    assert all(c.kind in ("raises", "cli") for c in CASES)
    for c in CASES:
        re.compile(c.match)


def _gen_module():
    spec = importlib.util.spec_from_file_location(
        "gen_bad_input_table", REPO_ROOT / "scripts" / "gen_bad_input_table.py"
    )
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_docs_table_matches_catalogue() -> None:
    gen = _gen_module()
    current = gen.page_block(gen.PAGE.read_text())
    assert current is not None, f"{gen.PAGE} lacks the generated bad-input table markers"
    assert current == gen.render(), (
        "docs/bad-inputs.md table is stale: run  .venv/bin/python scripts/gen_bad_input_table.py --write"
    )
