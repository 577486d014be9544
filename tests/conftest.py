"""Shared fixtures: tiny random HF checkpoints (Llama, Qwen2, Mistral) and the default model;
a session check that the suite leaves ``/dev/shm`` no fuller than it found it."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

# -- /dev/shm after the suite holds no more than before ---------------------------------------
# Every process this session starts inherits SESSION_ENV (engines, vLLM instances, Ray
# workers), so a file a live process still holds at the end is told apart: one of this
# session's processes (a leaked process: counted) or another run on the host (not counted).
SESSION_ENV = "DUALPATH_TEST_SESSION"
os.environ[SESSION_ENV] = f"{os.getpid()}-{secrets.token_hex(4)}"
SHM = Path("/dev/shm")
SHM_SETTLE_S = 30.0  # how long the check waits for this session's exiting processes


def shm_sizes() -> dict[str, int]:
    """Every file in /dev/shm and its size (apparent bytes)."""
    sizes = {}
    for entry in os.scandir(SHM) if SHM.is_dir() else ():
        try:
            sizes[entry.name] = entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue  # gone meanwhile
    return sizes


def shm_holders() -> dict[tuple[int, int], list[str]]:
    """(device, inode) of each /dev/shm file a live process maps or holds, and who: ``pid
    command`` of each holder, marked ``(this session)`` for this session's processes."""
    from dualpath.kv.shm_files import held_by

    device, mine = os.stat(SHM).st_dev, os.environ[SESSION_ENV].encode()
    holders: dict[tuple[int, int], list[str]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        process = Path(entry.path)
        try:
            held = held_by(process, device)
            ours = (f"{SESSION_ENV}=".encode() + mine in (process / "environ").read_bytes()
                    or entry.name == str(os.getpid()))  # set after pytest started
            command = (process / "cmdline").read_bytes().replace(b"\0", b" ")[:80].decode(
                "utf-8", "replace").strip()
        except OSError:
            continue  # exited, or not ours to read
        for key in held:
            holders.setdefault(key, []).append(
                f"pid {entry.name} {command!r}" + (" (this session)" if ours else ""))
    return holders


def shm_leaks(before: dict[str, int]) -> list[str]:
    """The files /dev/shm holds now beyond ``before`` (new, or grown), each described, except
    those only processes of other runs on this host hold."""
    now = shm_sizes()
    grown = {name: size for name, size in now.items() if size > before.get(name, -1)}
    if not grown:
        return []
    holders = shm_holders()
    leaks = []
    for name, size in sorted(grown.items()):
        try:
            info = os.lstat(SHM / name)
        except OSError:
            continue
        who = holders.get((info.st_dev, info.st_ino), [])
        if who and not any(w.endswith("(this session)") for w in who):
            continue  # another run's live file
        was = f", was {before[name]:,} bytes" if name in before else ""
        leaks.append(f"{name} ({size:,} bytes{was}; "
                     + (f"held by {', '.join(who)})" if who else "no process holds it)"))
    return leaks


@pytest.fixture(scope="session", autouse=True)
def shm_left_as_found():
    """Fails the session when /dev/shm holds more after it than before (a vLLM segment, a
    pool file, a storage-NIC file...), naming each file and who holds it."""
    before = shm_sizes()
    yield
    deadline = time.monotonic() + SHM_SETTLE_S
    while (leaks := shm_leaks(before)) and time.monotonic() < deadline:
        if not any("(this session)" in leak for leak in leaks):
            break  # no process of this session is still exiting: waiting changes nothing
        time.sleep(0.5)
    if leaks:
        pytest.fail(f"/dev/shm holds {len(leaks)} more files after the tests than before "
                    "(none held by another run's live process; remove them once reported):\n  "
                    + "\n  ".join(leaks), pytrace=False)


def _save_tiny(folder: Path, config, seed: int) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # HF initializes biases to zero: make them matter
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rms_norm_eps=1e-5, eos_token_id=299)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False)
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), cfg, seed=1)


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    cfg = LlamaConfig(**TINY, rope_parameters=rope, tie_word_embeddings=True)
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama3"), cfg, seed=2)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    from transformers import Qwen2Config

    cfg = Qwen2Config(**TINY, rope_theta=1000000.0, tie_word_embeddings=True,
                      use_sliding_window=False)
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), cfg, seed=3)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    from transformers import MistralConfig

    cfg = MistralConfig(**TINY, rope_theta=10000.0, sliding_window=24)
    return _save_tiny(tmp_path_factory.mktemp("tiny-mistral"), cfg, seed=4)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted default model (``make test`` prepares it before the suite runs)."""
    from dualpath.model.default_model import ensure_default_model

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return ensure_default_model(verbose=False)


# The modules that take longest, longest first (seconds under `make test`'s two workers on the
# 2-core EPYC, 2026-12-07). They start first, so that the workers, which take whole modules
# (`--dist loadfile`), end together instead of one running a long module alone at the end.
LONGEST_FIRST = (
    "integrations/test_vllm_connector.py",  # 155
    "integrations/test_vllm_faults.py",  # 145
    "integrations/test_vllm_serve.py",  # 142
    "cluster/test_faults.py",  # 126
    "integrations/test_vllm_pd.py",  # 121
    "cluster/test_multiturn.py",  # 96
    "cluster/test_fences.py",  # 89
    "test_bench_layerwise.py",  # 68
    "test_bench_engine.py",  # 67
    "bench/test_bench_agents.py",  # 58
    "integrations/test_vllm_shm.py",  # 50
    "test_bench_cluster.py",  # 48
    "engine/test_engine.py",  # 48
    "server/test_api_stream_moves.py",  # 46
    "cluster/test_ray_launcher.py",  # 44
    "server/test_api_fuzz.py",  # 40
    "storage/test_mooncake_store.py",  # 40
)


def longest_first(path: str) -> int:
    """Where a test module (``tests/...`` relative path) starts: its rank in
    ``LONGEST_FIRST``, or after all of them."""
    rel = path.removeprefix("tests/")
    return LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """The longest modules first (each module's tests keep their order); tests marked ``gpu``
    skip cleanly on machines without CUDA."""
    items.sort(key=lambda item: longest_first(item.nodeid.split("::", 1)[0]))  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_chaotic_dir(tmp_path_factory) -> Path:
    """A tiny Llama with large weights, so greedy text varies (a KV mistake shows)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY, rope_theta=10000.0, initializer_range=0.3)
    return _save_tiny(tmp_path_factory.mktemp("tiny-chaotic"), cfg, seed=6)


@pytest.fixture(scope="session")
def tiny_long_dir(tmp_path_factory) -> Path:
    """Like ``tiny_chaotic_dir`` with 8,192 positions, for requests that must stay decoding
    while a test acts on them (900 tokens of the 1,024-position model took 0.45 s)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**TINY, "max_position_embeddings": 8192}, rope_theta=10000.0,
                      initializer_range=0.3)
    return _save_tiny(tmp_path_factory.mktemp("tiny-long"), cfg, seed=6)


@pytest.fixture(scope="session")
def tiny_deep_dir(tmp_path_factory) -> Path:
    """Like ``tiny_chaotic_dir`` with 6 layers, so a 2-layer window is reused three times."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**TINY, "num_hidden_layers": 6}, rope_theta=10000.0,
                      initializer_range=0.3)
    return _save_tiny(tmp_path_factory.mktemp("tiny-deep"), cfg, seed=7)


# The real traces are found only through DUALPATH_TRACES_DIR
# (dualpath.workloads.trace_files.trace_dir);
# point it at <repo>/../shared/traces, where this dev checkout and CI keep them, unless the
# caller chose a folder. It is set even when that folder is absent, so that modules calling
# trace_dir() at import still load and the tests needing the traces skip on the missing folder.
os.environ.setdefault("DUALPATH_TRACES_DIR",
                      str(Path(__file__).resolve().parents[2] / "shared" / "traces"))


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tiny_llama_dir, smollm2_dir, tmp_path_factory) -> Path:
    """The tiny Llama with the default model's tokenizer beside it (``dualpath serve`` needs
    one to start; token ids below the tiny vocabulary decode like any others)."""
    import shutil

    folder = tmp_path_factory.mktemp("tiny-tok")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder
