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


def test_help_lists_every_command_on_one_line_and_imports_none_of_them():
    import subprocess
    import sys

    from dualpath.cli import COMMANDS

    code = ("import sys\nfrom dualpath.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('dualpath.') "
            "and m not in ('dualpath.cli', 'dualpath.errors')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    lines = out.splitlines()
    lines = lines[lines.index("every command:"):]
    for path, command in COMMANDS.items():
        named = [line for line in lines if line.split(None, len(path))[:len(path)] == list(path)
                 and command.help in line]
        assert len(named) == 1, (path, out)
    assert lines[-1] == "[]"  # no command module was imported


def test_every_commands_arguments_are_the_fields_of_its_options():
    import argparse
    from dataclasses import MISSING, fields

    from dualpath.cli import COMMANDS, _function, options_type

    for path in COMMANDS:
        parser = argparse.ArgumentParser()
        _function(path, "add_arguments")(parser)
        dests = {a.dest for a in parser._actions if a.dest != "help"}
        kind = options_type(path)
        names = {f.name for f in fields(kind)}
        required = {f.name for f in fields(kind)
                    if f.default is MISSING and f.default_factory is MISSING}
        assert dests <= names, (path, dests - names)
        assert required <= dests, (path, required - dests)
        assert kind.__dataclass_params__.frozen, path


def test_engine_overrides_set_fields_by_name_and_name_a_bad_key():
    from dualpath.config import EngineConfig

    config = EngineConfig.with_overrides(["kv_cache_mb=256", "cpu_kernels=false",
                                          "gil_switch_ms=1.5"], dtype="float32", threads=2)
    assert (config.kv_cache_mb, config.cpu_kernels, config.gil_switch_ms) == (256, False, 1.5)
    assert (config.dtype, config.threads, config.device) == ("float32", 2, "cpu")
    assert EngineConfig.with_overrides(["device=auto"]).device == "auto"  # the caller resolves
    for bad in ("no_such_field=1", "kv_cache_mb"):
        with pytest.raises(ValueError, match="expected KEY=VALUE"):
            EngineConfig.with_overrides([bad])


def test_python_m_entries_run_their_dualpath_command(monkeypatch):
    from dualpath.bench import gpu_check
    from dualpath.bench.soak import command as soak
    from dualpath.storage import mooncake_service
    from dualpath.transfer import mooncake_wheel
    from dualpath.workloads import sample

    seen = []
    monkeypatch.setattr("dualpath.cli.main", lambda argv: seen.append(argv) or 0)
    assert soak.main(["--agents", "3"]) == gpu_check.main(["--budget-s", "9"]) == 0
    assert mooncake_service.main(["master", "--port", "1"]) == 0
    assert mooncake_wheel.main(["trim", "w.whl"]) == sample.main(["--json", "s.json"]) == 0
    assert seen == [["bench", "soak", "--agents", "3"], ["bench", "gpu-check", "--budget-s", "9"],
                    ["mooncake", "master", "--port", "1"], ["mooncake", "wheel", "trim", "w.whl"],
                    ["workloads", "sample", "--json", "s.json"]]
