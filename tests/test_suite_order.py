"""The suite's own scheduling (``tests/conftest.py``: ``LONGEST_FIRST``): the modules it
starts first exist, so a renamed module does not silently fall to the end of the run."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def suite(pytestconfig) -> ModuleType:
    """This suite's conftest as pytest loaded it (other folders' conftests share its name)."""
    module = pytestconfig.pluginmanager.get_plugin(str(TESTS / "conftest.py"))
    assert module is not None
    return module


def test_every_module_started_first_exists(suite):
    missing = [rel for rel in suite.LONGEST_FIRST if not (TESTS / rel).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names modules that are gone: {missing}"


def test_the_longest_modules_rank_first_and_the_rest_after_them(suite):
    first, rank = suite.LONGEST_FIRST, suite.longest_first
    assert rank("tests/" + first[0]) == 0 and rank("tests/" + first[-1]) == len(first) - 1
    assert rank("tests/test_cli.py") == len(first)
