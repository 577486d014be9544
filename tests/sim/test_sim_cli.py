"""``dualpath sim`` options: the baselines' batcher and bad combinations."""

import argparse

import pytest

from dualpath.cli import main
from dualpath.sim.commands import _paper_base
from dualpath.sim.presets import DS660B, DS660B_QUOTA_ALL


def _args(**kw):
    base = {"preset": "paper-fig7", "baseline_batcher": None, "token_budget": None,
            "read_queue": None, "storage_eff": None, "basic_prefetch": False,
            "lengths": None}
    return argparse.Namespace(**{**base, **kw})


def test_paper_base_applies_the_batcher_options():
    assert _paper_base(_args(baseline_batcher="stock")) == DS660B
    assert _paper_base(_args(baseline_batcher="quota")) == DS660B_QUOTA_ALL
    assert _paper_base(_args(token_budget=4096)).token_budget == 4096
    assert _paper_base(_args(read_queue="shared")).read_streams is None
    assert _paper_base(_args(read_queue="fifo")).read_streams == DS660B.read_streams == 1


def test_paper_base_is_none_without_paper_options():
    assert _paper_base(_args()) is None
    assert _paper_base(_args(preset="testbed")) is None


def test_paper_base_applies_the_storage_what_ifs():
    assert _paper_base(_args(storage_eff=0.6)).storage_eff == 0.6
    assert DS660B.storage_eff == 0.8 and not DS660B.basic_prefetch
    assert _paper_base(_args(basic_prefetch=True)).basic_prefetch
    assert _paper_base(_args(lengths="varied")).workload.lengths == "varied"
    assert DS660B.workload.lengths == "same"


@pytest.mark.parametrize("argv, needle", [
    (["--preset", "paper-fig7", "--token-budget", "0"], "--token-budget must be positive"),
    (["--preset", "paper-fig7", "--storage-eff", "1.5"], "--storage-eff must be in (0, 1]"),
    (["--preset", "testbed", "--testbed", "p.json", "--basic-prefetch"],
     "apply to the paper presets"),
    (["--preset", "testbed", "--testbed", "p.json", "--baseline-batcher", "quota"],
     "apply to the paper presets"),
    (["--preset", "paper-scale", "--agents", "8"], "--agents applies to"),
])
def test_bad_combinations_are_named(argv, needle, capsys):
    assert main(["sim", *argv]) == 2
    assert needle in capsys.readouterr().err
