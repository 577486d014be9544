"""dualpath's KV connector under vLLM (CPU build, SmolLM2): a 2-turn chat, each turn with the
connector in a fresh process, so turn 2's hit can only come from our store (issue 36, PE path).

Five vLLM starts in all (about a minute each on this 2-core machine): plain vLLM (both turns in
one process, no store), the connector's turn 1 and turn 2, and turn 2 again on two damaged
copies of turn 1's store. Skipped where ``make peers`` has not run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integrations.test_vllm_env import ROOT, peers_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # several vLLM starts in one fixture

SCRIPT = Path(__file__).with_name("vllm_chat.py")
TURNS = ("How do we verify a stored block?", "And what if the checksum fails?")
LOADED = re.compile(r"dualpath connector: loaded (\d+) blocks \((\d+) tokens\), (\d+) failed")


def chat(tmp: Path, name: str, users: tuple[str, ...], store: Path | None = None,
         history: Path | None = None, *extra: str) -> tuple[list[dict], str]:
    """Run ``vllm_chat.py`` in the peers' python (``extra``: more of its arguments): the turns
    and the process's log; the whole answer stays in ``tmp/NAME.json``."""
    out = tmp / f"{name}.json"
    model = json.loads((tmp / "model.json").read_text())
    cmd = [str(peers_python()), str(SCRIPT), "--model", model, "--out", str(out), *extra]
    for user in users:
        cmd += ["--user", user]
    if store is not None:
        cmd += ["--store", str(store)]
    if history is not None:
        cmd += ["--history", str(history)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    (tmp / f"{name}.log").write_text(log)
    assert done.returncode == 0, log[-3000:]
    return json.loads(out.read_text())["turns"], log


def loads(log: str) -> tuple[int, int]:
    """Tokens loaded and blocks that failed to load, over the process's steps."""
    found = [(int(tokens), int(failed)) for _, tokens, failed in LOADED.findall(log)]
    return sum(t for t, _ in found), sum(f for _, f in found)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_dir):
    peers_python()  # skip before preparing anything
    tmp = tmp_path_factory.mktemp("vllm-connector")
    (tmp / "model.json").write_text(json.dumps(str(smollm2_dir)))
    store = tmp / "store"
    plain, _ = chat(tmp, "plain", TURNS)
    first, first_log = chat(tmp, "turn1", TURNS[:1], store)
    shutil.copytree(store, tmp / "turn1-store")
    second, second_log = chat(tmp, "turn2", TURNS[1:], store, history=tmp / "turn1.json")
    return {"tmp": tmp, "plain": plain, "first": first, "first_log": first_log,
            "second": second, "second_log": second_log}


def stored_blocks(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


def test_turn_two_hits_turn_one_and_greedy_tokens_equal_plain_vllm(runs):
    plain, second = runs["plain"], runs["second"]
    assert runs["first"][0] == plain[0]
    assert second[1]["prompt"] == plain[1]["prompt"]
    assert second[1]["output"] == plain[1]["output"]
    assert loads(runs["first_log"]) == (0, 0)  # turn 1: an empty store
    loaded, failed = loads(runs["second_log"])
    assert loaded >= 3 * 32 and failed == 0  # turn 1's prompt and output, whole blocks


def test_corrupt_block_files_are_misses_and_tokens_still_equal_plain(runs):
    from dualpath.storage.block_file import HEADER_BYTES

    tmp = runs["tmp"]
    store = tmp / "corrupt-store"
    shutil.copytree(tmp / "turn1-store", store)
    files = stored_blocks(store)
    assert files
    rng = __import__("random").Random(0)
    for path in files:  # random bytes over every payload: the checksums no longer match
        size = path.stat().st_size - HEADER_BYTES
        with path.open("r+b") as f:
            f.seek(HEADER_BYTES)
            f.write(rng.randbytes(size))
    turns, log = chat(tmp, "corrupt", TURNS[1:], store, history=tmp / "turn1.json")
    loaded, failed = loads(log)
    assert failed >= 3 and loaded == 0
    assert turns[1]["output"] == runs["plain"][1]["output"]
    # the damaged files are gone, and a request whose load failed saves nothing more
    assert stored_blocks(store) == []


def test_random_kv_stored_under_valid_checksums_changes_the_tokens(runs):
    from dualpath.kv.layout import KVLayout
    from dualpath.storage.fs import FsStore

    tmp = runs["tmp"]
    store_root = tmp / "random-store"
    shutil.copytree(tmp / "turn1-store", store_root)
    layout = KVLayout(30, 3, 64, "bfloat16", 32)  # SmolLM2-135M, vLLM's block size here
    rng = __import__("random").Random(1)
    with FsStore(store_root, layout) as store:
        keys = [store.read_block(k) for k in store.stored_keys()]
        assert keys and all(keys)
        store.delete(keys)
        by_parent = {k.parent: k for k in keys}
        chain, parent = [], None
        while parent in by_parent:  # parents first
            chain.append(by_parent[parent])
            parent = chain[-1].block_hash
        assert len(chain) == len(keys)
        # Random values, not random bits: bf16 with the exponent of numbers near 1, so the
        # model reads plausible but wrong KV (a checksum over them is valid).
        payload = [bytearray(b for _ in range(layout.full_block_bytes // 2)
                             for b in (rng.randrange(256), 0x3F | rng.choice((0, 0x80))))
                   for _ in chain]
        assert all(store.put_from(chain, payload))
    turns, log = chat(tmp, "random", TURNS[1:], store_root, history=tmp / "turn1.json")
    loaded, failed = loads(log)
    assert loaded >= 3 * 32 and failed == 0
    assert turns[1]["output"] != runs["plain"][1]["output"]
