"""The suite's own scheduling (``tests/suite_order.py``, applied in ``tests/conftest.py``):
the modules it starts first exist, so a renamed module does not silently fall to the end."""

from __future__ import annotations

from pathlib import Path

from suite_order import LONGEST_FIRST, longest_first

TESTS = Path(__file__).resolve().parent


def test_every_module_started_first_exists():
    missing = [rel for rel in LONGEST_FIRST if not (TESTS / rel).is_file()]
    assert not missing, f"tests/suite_order.py LONGEST_FIRST names modules that are gone: {missing}"


def test_the_longest_modules_rank_first_and_the_rest_after_them():
    assert longest_first("tests/" + LONGEST_FIRST[0]) == 0
    assert longest_first("tests/" + LONGEST_FIRST[-1]) == len(LONGEST_FIRST) - 1
    assert longest_first("tests/test_cli.py") == len(LONGEST_FIRST)
