"""``dualpath store verify``: recompute sampled stored chains with the model and compare KV."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dualpath.errors import DualPathError

if TYPE_CHECKING:
    from argparse import ArgumentParser


@dataclass(frozen=True)
class StoreVerifyOptions:
    """The ``dualpath store verify`` command line."""

    storage: str | None = None
    model: str | None = None
    config: str | None = None
    sets: tuple[str, ...] = ()
    sample: int = 64
    all: bool = False
    seed: int = 0
    dtype: str | None = None
    device: str = "cpu"
    threads: int = 1
    json: str | None = None


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`StoreVerifyOptions`."""
    parser.add_argument("--storage", default=None,
                        help="KV store root, an fs directory (default: the config's "
                        "storage.root)")
    parser.add_argument("--model", default=None,
                        help="HF model folder (default: the config's serve.model, else SmolLM2)")
    parser.add_argument("--config", default=None, help="the TOML config the cluster ran with")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. engine.cpu_kernels=false (repeatable)")
    parser.add_argument("--sample", type=int, default=64,
                        help="blocks checked per KV layout, each with its whole chain "
                        "(default 64)")
    parser.add_argument("--all", action="store_true", help="check every stored block")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample")
    parser.add_argument("--dtype", default=None,
                        help="compute dtype (default: the config's engine.dtype, else the KV's)")
    parser.add_argument("--device", default="cpu", help="where to recompute (default cpu)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", default=None, help="also write the report here")


def run(options: StoreVerifyOptions) -> int:
    """Print the report (and write it to ``--json``); 1 when a block does not match or blocks
    of the model could not be checked (each reason on stderr, with its count)."""
    import json
    import sys

    import torch

    from dualpath.config_file import load_config
    from dualpath.model.default_model import resolve_model
    from dualpath.storage.verify import verify_fs_root

    base = {k: v for k, v in (("storage.root", options.storage), ("serve.model", options.model))
            if v is not None}
    config = load_config(options.config, list(options.sets), base)
    storage, engine = config.cluster.storage, config.cluster.engine
    if storage.backend != "fs":
        raise DualPathError(f"store verify lists the blocks of an fs store; {storage.backend} "
                            "cannot (from Python: storage.verify.verify_store(store, model, "
                            "keys=...))")
    torch.set_num_threads(options.threads)
    dtype = options.dtype or (engine.dtype if engine.dtype != "auto" else None)
    report = verify_fs_root(storage.root, resolve_model(config.serve.model),
                            sample=None if options.all else options.sample, seed=options.seed,
                            dtype=dtype, cpu_kernels=engine.cpu_kernels, device=options.device,
                            progress=True)
    text = json.dumps(report.to_dict(), indent=2)
    if options.json:
        with open(options.json, "w") as f:
            f.write(text + "\n")
    print(text)
    for line in report.failures():
        print(f"store verify: {line}", file=sys.stderr)
    return 0 if report.ok else 1
