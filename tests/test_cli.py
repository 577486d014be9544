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



def test_store_verify_exits_non_zero_on_a_mismatch(tiny_llama_dir, tmp_path, capsys):
    import json

    from storage.test_verify import _layout, _save_like_a_decode_engine, _swap_payload

    from dualpath.storage.fs import FsStore

    root, out = tmp_path / "kv", tmp_path / "report.json"
    with FsStore(root, _layout(tiny_llama_dir, "float32")) as store:
        chains = _save_like_a_decode_engine(tiny_llama_dir, store)
    args = ["store", "verify", "--storage", str(root), "--model", str(tiny_llama_dir), "--all",
            "--json", str(out)]
    assert main(args) == 0
    good = json.loads(out.read_text())
    assert good["ok"] and good["num_checked"] == sum(map(len, chains)) > 0
    assert json.loads(capsys.readouterr().out) == good  # the report on stdout too
    with FsStore(root, _layout(tiny_llama_dir, "float32")) as store:
        _swap_payload(store, chains[0][1], chains[2][1])  # a valid block of the wrong KV
    assert main(args) == 1
    bad = json.loads(out.read_text())
    assert not bad["ok"] and [m["key"] for m in bad["mismatched"]] == [chains[0][1].name]
    sampled = [a for a in args if a != "--all"]
    assert main([*sampled, "--sample", "0"]) == 0  # nothing sampled, nothing found

def test_store_verify_refuses_a_store_it_cannot_list(tiny_llama_dir, capsys):
    assert main(["store", "verify", "--model", str(tiny_llama_dir),
                 "--set", "storage.backend=mooncake_store"]) == 2
    assert "cannot" in capsys.readouterr().err


def _serve_config(monkeypatch, argv: list[str]):
    """The AppConfig ``dualpath serve ARGV`` would run (nothing is started)."""
    import dualpath.server.serve as serve_module

    seen = []
    monkeypatch.setattr(serve_module, "serve", lambda config: seen.append(config))
    assert main(["serve", *argv]) == 0
    return seen[0]


def test_serve_takes_the_store_capacity_as_a_flag_or_a_setting(monkeypatch):
    flag = _serve_config(monkeypatch, ["--store-capacity-gb", "12.5"])
    assert flag.cluster.storage.capacity_gb == 12.5
    setting = _serve_config(monkeypatch, ["--set", "storage.capacity_gb=7"])
    assert setting.cluster.storage.capacity_gb == 7.0
    unset = _serve_config(monkeypatch, [])
    assert unset.cluster.storage.capacity_gb is None  # serve picks the default at start
    assert unset.serve.store_capacity_fraction == 0.5 and unset.serve.keep_runs == 10


def test_serve_refuses_a_capacity_that_is_not_a_positive_size(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--store-capacity-gb", "-1"])
    assert "expected a size in GB > 0" in capsys.readouterr().err


def test_keys_writes_owner_only_files_the_router_and_engines_read(tmp_path, capsys):
    import stat

    from dualpath.control_keys import ClusterKeys, engine_key_from

    assert main(["keys", str(tmp_path / "k"), "--engines", "pe0,de1"]) == 0
    assert "control_keys=" in capsys.readouterr().out
    keys = ClusterKeys.load(tmp_path / "k")
    assert set(keys.engines) == {"pe0", "de1"}
    de1 = engine_key_from(str(tmp_path / "k" / "engines" / "de1.json"), "de1")
    assert de1.router_public == keys.router.public and de1.keys == keys.engines["de1"]
    for path in [tmp_path / "k" / "router.json", *(tmp_path / "k" / "engines").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert main(["keys", str(tmp_path / "j"), "--engines", "pe0,../x"]) == 2
    assert main(["keys", str(tmp_path / "j"), "--engines", "pe0,pe0"]) == 2
