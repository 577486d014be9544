"""model_id covers every byte of the weights; cached digests serve only unchanged files."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dualpath.model import default_model, fingerprint
from dualpath.model.spec import model_id

ROOT = Path(__file__).resolve().parents[2]
WEIGHT_BYTES = 3 * (1 << 20) + 12345  # more than the first and last MiB the old id read


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "dualpath-cache"
    monkeypatch.setenv("DUALPATH_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def checkpoint(tmp_path):
    """A folder with a config and two weight shards of random bytes (model_id never parses them)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    for i in range(2):
        path = folder / f"model-0000{i + 1}-of-00002.safetensors"
        path.write_bytes(os.urandom(WEIGHT_BYTES))
    return folder


def _age(path, seconds):
    """Move mtime ``seconds`` into the past."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - seconds * 10**9))


def _flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def hashed(monkeypatch):
    """Names of the files really hashed (not answered from the cache)."""
    calls = []
    real = fingerprint.hash_file

    def counting(path):
        calls.append(path.name)
        return real(path)

    monkeypatch.setattr(fingerprint, "hash_file", counting)
    return calls


def test_one_byte_in_the_middle_of_a_weight_file_changes_the_id(checkpoint, tmp_path):
    fine_tune = tmp_path / "fine-tune" / checkpoint.name
    shutil.copytree(checkpoint, fine_tune)
    assert model_id(fine_tune) == model_id(checkpoint)  # the folder name, not the path, counts
    _flip_middle_byte(next(fine_tune.glob("*.safetensors")))
    assert model_id(fine_tune) != model_id(checkpoint)


def test_second_call_answers_from_the_cache(checkpoint, hashed, cache_dir):
    first = model_id(checkpoint)
    assert sorted(hashed) == sorted(p.name for p in checkpoint.glob("*.safetensors"))
    assert (cache_dir / fingerprint.CACHE_FILE).is_file()
    hashed.clear()
    assert model_id(checkpoint) == first
    assert hashed == []


def test_touching_a_file_hashes_it_again(checkpoint, hashed):
    first = model_id(checkpoint)
    path = sorted(checkpoint.glob("*.safetensors"))[1]
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    hashed.clear()
    assert model_id(checkpoint) == first  # same bytes, same id
    assert hashed == [path.name]
    hashed.clear()
    model_id(checkpoint)
    assert hashed == []


def test_new_content_with_the_old_mtime_and_size_is_hashed_again(checkpoint, hashed):
    """Like ``rsync -a`` of a fine-tune over its base model: new inode, old mtime, same size."""
    first = model_id(checkpoint)
    path = next(checkpoint.glob("*.safetensors"))
    st = path.stat()
    swapped = path.with_suffix(".new")
    shutil.copyfile(path, swapped)
    _flip_middle_byte(swapped)
    os.utime(swapped, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(swapped, path)
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    hashed.clear()
    assert model_id(checkpoint) != first
    assert hashed == [path.name]


def test_corrupt_cache_is_ignored_and_rewritten(checkpoint, hashed, cache_dir):
    first = model_id(checkpoint)
    cache = cache_dir / fingerprint.CACHE_FILE
    for junk in ("{not json", "[1, 2]", '{"version": 1, "files": {"x": 3}}', ""):
        cache.write_text(junk)
        hashed.clear()
        assert model_id(checkpoint) == first
        assert len(hashed) == 2
    assert json.loads(cache.read_text())["version"] == fingerprint.CACHE_VERSION


def test_tampered_entries_are_not_trusted(checkpoint, hashed, cache_dir):
    first = model_id(checkpoint)
    cache = cache_dir / fingerprint.CACHE_FILE
    data = json.loads(cache.read_text())
    for entry in data["files"].values():
        entry["stat"][0] += 1  # recorded for another size
    cache.write_text(json.dumps(data))
    hashed.clear()
    assert model_id(checkpoint) == first
    assert len(hashed) == 2


def test_unwritable_cache_folder_still_gives_the_id(checkpoint, hashed, tmp_path, monkeypatch):
    first = model_id(checkpoint)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DUALPATH_CACHE_DIR", str(blocker / "cache"))  # mkdir fails
    hashed.clear()
    assert model_id(checkpoint) == first
    assert len(hashed) == 2


def test_save_merges_entries_another_process_wrote_meanwhile(checkpoint, tmp_path, cache_dir):
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"x" * 100)
    real = fingerprint.hash_file

    def hash_while_another_process_saves(path):
        if path.name != other.name:
            fingerprint.weight_digests([other])  # lands between our load and our save
        return real(path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fingerprint, "hash_file", hash_while_another_process_saves)
        model_id(checkpoint)
    entries = json.loads((cache_dir / fingerprint.CACHE_FILE).read_text())["files"]
    assert str(other.resolve()) in entries
    assert len(entries) == 3
    assert [p.name for p in cache_dir.iterdir()] == [fingerprint.CACHE_FILE]  # no temp left


def test_a_file_written_to_while_hashed_is_hashed_again(checkpoint, hashed):
    path = next(checkpoint.glob("*.safetensors"))
    real = fingerprint.hash_file

    def hash_then_write(p):
        digest = real(p)
        if p.name == path.name:  # a writer finishes just after we read the old bytes
            _flip_middle_byte(p)
            _age(p, seconds=50)
        return digest

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fingerprint, "hash_file", hash_then_write)
        model_id(checkpoint)
    hashed.clear()
    model_id(checkpoint)
    assert hashed == [path.name]


def test_processes_starting_at_once_agree_and_leave_a_valid_cache(checkpoint, cache_dir):
    code = "import sys; from dualpath.model.spec import model_id; print(model_id(sys.argv[1]))"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(checkpoint)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    ids = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert ids == {model_id(checkpoint)}
    entries = json.loads((cache_dir / fingerprint.CACHE_FILE).read_text())["files"]
    assert len(entries) == 2
    assert [p.name for p in cache_dir.iterdir()] == [fingerprint.CACHE_FILE]


def test_entries_of_deleted_files_are_dropped(checkpoint, tmp_path, cache_dir):
    gone = tmp_path / "gone.safetensors"
    gone.write_bytes(b"y" * 10)
    fingerprint.weight_digests([gone])
    gone.unlink()
    model_id(checkpoint)
    entries = json.loads((cache_dir / fingerprint.CACHE_FILE).read_text())["files"]
    assert str(gone.resolve()) not in entries
    assert len(entries) == 2


def test_symlinked_weights_share_the_entry_of_their_target(checkpoint, tmp_path, hashed):
    """Hugging Face hub snapshots are links to content-addressed blobs."""
    snapshot = tmp_path / "snapshot" / checkpoint.name
    snapshot.mkdir(parents=True)
    for path in checkpoint.iterdir():
        (snapshot / path.name).symlink_to(path)
    first = model_id(checkpoint)
    hashed.clear()
    assert model_id(snapshot) == first
    assert hashed == []


def test_digest_is_the_blake2b_of_the_whole_file(checkpoint):
    import hashlib

    path = next(checkpoint.glob("*.safetensors"))
    want = hashlib.blake2b(path.read_bytes(), digest_size=32).hexdigest()
    assert fingerprint.weight_digests([path]) == [want]


def test_cache_lives_in_the_default_model_cache_folder(cache_dir, monkeypatch):
    assert fingerprint.default_cache_path() == default_model.cache_dir() / fingerprint.CACHE_FILE
    monkeypatch.delenv("DUALPATH_CACHE_DIR")
    assert fingerprint.default_cache_path() == default_model.cache_dir() / fingerprint.CACHE_FILE
