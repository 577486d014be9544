"""A Mooncake peer in another process (run in a network namespace by ``test_listeners.py``): it
reads ``--nbytes`` at ``--addr`` of the backend ``--peer`` into a buffer of its own and prints
``{"ok": true, "data": HEX}``, or ``{"ok": false, "error": ...}`` when the read fails or takes
longer than ``--timeout`` seconds."""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import time

from dualpath.errors import TransferError
from dualpath.transfer.mooncake import MooncakeBackend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True, help="this peer's own address")
    parser.add_argument("--peer", required=True, help="the endpoint to read from")
    parser.add_argument("--addr", type=int, required=True)
    parser.add_argument("--nbytes", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()
    backend = MooncakeBackend(args.host, open_listeners=True)  # it only reads: nothing to guard
    buf = mmap.mmap(-1, max(4096, args.nbytes))
    local = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    backend.register(local, len(buf))
    try:
        pending = backend.start_read(args.peer, [(local, args.addr, args.nbytes)])
        deadline = time.monotonic() + args.timeout
        while not pending.poll():
            if time.monotonic() > deadline:
                raise TransferError(f"no answer in {args.timeout:g} s")
            time.sleep(0.01)
        result = {"ok": True, "data": buf[:args.nbytes].hex()}
    except TransferError as exc:
        result = {"ok": False, "error": str(exc)}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
