"""Chained block hashes: stable, prefix-identifying, seed-dependent and incremental."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dualpath.kv.hashing import DIGEST_BYTES, block_hash, extend_block_hashes, root_hash

ROOT = Path(__file__).resolve().parents[2]
SEED = "llama-L30-H576-kv3x64-V49152"
BLOCK = 4


def _hashes(tokens, block_size=BLOCK, seed=SEED):
    return extend_block_hashes([], tokens, block_size, seed)


def test_digests_are_16_bytes():
    assert DIGEST_BYTES == 16
    assert len(root_hash(SEED)) == 16
    assert len(block_hash(root_hash(SEED), [1, 2, 3, 4])) == 16
    assert all(isinstance(h, bytes) and len(h) == 16 for h in _hashes(list(range(20))))


def test_hashes_are_deterministic_in_process():
    tokens = list(range(100, 140))
    assert _hashes(tokens) == _hashes(list(tokens))
    assert root_hash(SEED) == root_hash(SEED)


_SUBPROCESS_CODE = """
import json
from dualpath.kv.hashing import extend_block_hashes, root_hash
hashes = extend_block_hashes([], list(range(1000, 1040)), 8, "seed-x")
print(json.dumps({"root": root_hash("seed-x").hex(), "blocks": [h.hex() for h in hashes]}))
"""


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_hashes_are_stable_across_processes(hash_seed):
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_CODE],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True,
    )
    theirs = json.loads(out.stdout)
    ours = extend_block_hashes([], list(range(1000, 1040)), 8, "seed-x")
    assert theirs["root"] == root_hash("seed-x").hex()
    assert theirs["blocks"] == [h.hex() for h in ours]


def test_only_full_blocks_are_hashed():
    assert _hashes([]) == []
    assert _hashes([1, 2, 3]) == []
    assert len(_hashes([1, 2, 3, 4])) == 1
    assert len(_hashes(list(range(10)))) == 2
    assert len(_hashes(list(range(12)))) == 3


def test_partial_tail_does_not_change_full_block_hashes():
    tokens = list(range(8))
    assert _hashes(tokens) == _hashes([*tokens, 99, 98, 97])


def test_first_hash_is_block_hash_of_root():
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    h = _hashes(tokens)
    assert h[0] == block_hash(root_hash(SEED), tokens[:4])
    assert h[1] == block_hash(h[0], tokens[4:8])


def test_changing_a_token_in_block_zero_changes_every_hash():
    tokens = list(range(24))
    changed = list(tokens)
    changed[1] += 1000
    a, b = _hashes(tokens), _hashes(changed)
    assert len(a) == len(b) == 6
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_change_in_a_later_block_keeps_earlier_hashes():
    tokens = list(range(24))
    changed = list(tokens)
    changed[2 * BLOCK] += 1000  # first token of block 2
    a, b = _hashes(tokens), _hashes(changed)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


def test_equal_block_contents_with_different_prefix_hash_differently():
    shared = [7, 7, 7, 7]
    a = _hashes([1, 2, 3, 4, *shared])
    b = _hashes([4, 3, 2, 1, *shared])
    assert a[1] != b[1]


def test_equal_hash_at_block_k_implies_equal_prefix():
    base = list(range(16))
    variants = [base, [*base[:12], 0, 0, 0, 0], [99, *base[1:]], [*base[:4], 50, *base[5:]]]
    for x in variants:
        for y in variants:
            hx, hy = _hashes(x), _hashes(y)
            for k in range(4):
                if hx[k] == hy[k]:
                    assert x[: (k + 1) * BLOCK] == y[: (k + 1) * BLOCK]


def test_hashes_depend_on_seed():
    tokens = list(range(16))
    a = _hashes(tokens, seed="model-a")
    b = _hashes(tokens, seed="model-b")
    assert root_hash("model-a") != root_hash("model-b")
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_token_order_within_a_block_matters():
    assert block_hash(b"p" * 16, [1, 2, 3, 4]) != block_hash(b"p" * 16, [4, 3, 2, 1])


def test_large_token_ids_are_not_truncated():
    parent = root_hash(SEED)
    assert block_hash(parent, [1, 2, 3, 4]) != block_hash(parent, [1 + 2**32, 2, 3, 4])


def test_extend_is_in_place_and_returns_the_same_list():
    hashes: list[bytes] = []
    result = extend_block_hashes(hashes, list(range(8)), BLOCK, SEED)
    assert result is hashes
    assert len(hashes) == 2


def test_extend_in_two_calls_equals_one_call():
    tokens = list(range(300, 330))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens[:6], BLOCK, SEED)
    assert len(hashes) == 1
    extend_block_hashes(hashes, tokens, BLOCK, SEED)
    assert hashes == _hashes(tokens)


def test_extend_token_by_token_equals_one_call():
    tokens = list(range(50, 73))
    hashes: list[bytes] = []
    for n in range(1, len(tokens) + 1):
        extend_block_hashes(hashes, tokens[:n], BLOCK, SEED)
    assert hashes == _hashes(tokens)


def test_extend_without_new_full_block_adds_nothing():
    tokens = list(range(10))
    hashes = _hashes(tokens)
    before = list(hashes)
    extend_block_hashes(hashes, tokens, BLOCK, SEED)
    assert hashes == before


def test_block_size_changes_the_hashes():
    tokens = list(range(16))
    assert _hashes(tokens, block_size=4)[1] != _hashes(tokens, block_size=8)[0]
