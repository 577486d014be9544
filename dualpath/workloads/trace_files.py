"""Where the real traces are: the folder named by the caller or ``$DUALPATH_TRACES_DIR``.

No folder is guessed: a user's clone has no ``../shared`` (the test suite points the variable
at ``../shared/traces`` when it exists). The folder holds ``weka-agentic-dev/`` and
``mooncake-synthetic/`` as ``shared/traces`` lays them out.
"""

from __future__ import annotations

import os
from pathlib import Path

TRACES = ("weka", "mooncake")
ENV_DIR = "DUALPATH_TRACES_DIR"
_FILES = {
    "weka": Path("weka-agentic-dev") / "weka_traces_dev.tar.xz",
    "mooncake": Path("mooncake-synthetic") / "synthetic_trace.jsonl",
}


def trace_dir() -> Path:
    """The traces folder named by ``$DUALPATH_TRACES_DIR``.

    Raises ``ValueError`` when the variable is unset or empty: no folder outside the
    repository is guessed (a user's clone has no ``../shared``), so pass ``--trace-dir`` or
    set the variable.
    """
    env = os.environ.get(ENV_DIR)
    if not env:
        raise ValueError(f"no traces folder given: pass --trace-dir or set {ENV_DIR} to the "
                         "folder holding weka-agentic-dev/ and mooncake-synthetic/")
    return Path(env)


def trace_file(name: str, root: Path | None = None) -> Path:
    """The data file of trace ``name`` under ``root`` (default :func:`trace_dir`).

    Raises ``ValueError`` for an unknown name, a missing folder or a missing file.
    """
    if name not in _FILES:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACES)}")
    folder = Path(root) if root is not None else trace_dir()
    if not folder.is_dir():
        raise ValueError(f"traces folder {folder} does not exist (pass --trace-dir or set "
                         f"{ENV_DIR})")
    path = folder / _FILES[name]
    if not path.is_file():
        raise ValueError(f"trace file {path} for {name!r} does not exist")
    return path


def traces_folder(name: str, given: Path | str | None) -> Path:
    """``given``, else ``$DUALPATH_TRACES_DIR``, for workload ``name`` (the path may also be
    a trace file or a folder of them: :func:`dualpath.workloads.weka.weka_source`,
    :func:`dualpath.workloads.mooncake.mooncake_file`).

    Raises ``ValueError`` naming ``--trace-dir`` and the variable when neither is given or the
    path does not exist.
    """
    hint = f"pass --trace-dir or set {ENV_DIR}"
    if given is None:
        given = os.environ.get(ENV_DIR) or None
        if given is None:
            raise ValueError(f"workload {name!r} needs a traces folder: {hint} (or use the "
                             "shipped weka-sample)")
    path = Path(given)
    if not path.exists():
        raise ValueError(f"traces folder {path} for {name!r} does not exist ({hint})")
    return path
