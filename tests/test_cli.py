"""The ``dualpath`` command: the demo answer and clear errors for bad input."""

from __future__ import annotations

import pytest

from dualpath.cli import main


def test_generate_answers_paris(smollm2_dir, capsys):
    assert main(["generate", "What is the capital of France?", "--max-tokens", "30"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_generate_raw_with_stop_and_sampling(smollm2_dir, capsys):
    args = ["generate", "The capital of France is", "--raw", "--max-tokens", "12",
            "--temperature", "0.7", "--top-p", "0.9", "--seed", "3", "--stop", "\n"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first  # seeded: reproducible


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "hi", "--model", "/no/such/folder"], "not an HF model folder"),
        (["generate", "hi", "--top-p", "1.5"], "top_p"),
        (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
        (["generate", "hi", "--set", "no_such_field=1"], "expected KEY=VALUE"),
        (["generate", "hi", "--dtype", "int3"], "unsupported dtype"),
    ],
)
def test_bad_input_is_a_clear_error(smollm2_dir, capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("dualpath: error:") and message in err
