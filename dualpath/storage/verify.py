"""``dualpath store verify``: recompute sampled stored chains and compare their KV (docs/design.md
§9).

For each sampled block the audit walks the chain back to its root through the stored parent
hashes, checks the stored token ids hash to each key (else a *token mismatch*), prefills the
chain's tokens with the model (``recompute.py``; one load for every chain) and compares stored
and recomputed KV: a block's error is the largest ``||stored - recomputed|| / ||recomputed||``
over its layers, and one above its KV dtype's ``TOLERANCE`` is a *mismatch*. A block saved
without token ids, one whose chain holds such a block or a token mismatch, and one missing or
damaged (or with such an ancestor) is *unverifiable*, counted by reason, never an error.

What it proves, and the measurements behind ``TOLERANCE``: docs/derivations.md,
'storage/verify.py'.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dualpath.errors import StorageError
from dualpath.kv.hashing import BlockKey, KeySpace, block_hash, root_hash
from dualpath.kv.layout import KVLayout
from dualpath.model.spec import DTYPE_BYTES, ModelSpec, load_spec, model_id
from dualpath.storage.base import StorageBackend

TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
DEFAULT_SAMPLE = 64
_COMPARED, _TOKENS, _UNVERIFIABLE = "compared", "token_mismatch", "unverifiable"


@dataclass
class VerifyReport:
    """What an audit found (``to_dict`` is JSON-able). ``ok`` is False when any block's KV or
    token ids disagree with its key."""

    model_id: str
    layouts: list[str] = field(default_factory=list)
    num_blocks: int = 0  # blocks listed (or given), of any model and layout
    num_sampled: int = 0  # blocks of this model's layouts picked for the audit
    num_checked: int = 0  # blocks whose KV was recomputed and compared (with their ancestors)
    num_ok: int = 0
    num_mismatched: int = 0
    mismatched: list[dict[str, Any]] = field(default_factory=list)  # key, error, layer
    num_token_mismatches: int = 0
    num_salted_roots: int = 0  # chains whose root key needs the tenant's salt to check
    token_mismatches: list[str] = field(default_factory=list)  # key names
    num_unverifiable: int = 0
    unverifiable: dict[str, int] = field(default_factory=dict)  # reason -> blocks
    skipped: dict[str, int] = field(default_factory=dict)  # other_model / other_layout -> blocks
    max_error: dict[str, float] = field(default_factory=dict)  # per KV dtype, over ok blocks
    tolerance: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No mismatched KV and no token ids that fail their key."""
        return not (self.num_mismatched or self.num_token_mismatches)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data."""
        return {**asdict(self), "ok": self.ok}

    def merge(self, other: VerifyReport) -> VerifyReport:
        """This report and ``other`` (another layout of the same store) as one."""
        out = VerifyReport(self.model_id, self.layouts + other.layouts,
                           tolerance={**self.tolerance, **other.tolerance})
        for name in ("num_blocks", "num_sampled", "num_checked", "num_ok", "num_mismatched",
                     "num_token_mismatches", "num_unverifiable", "num_salted_roots"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.mismatched = self.mismatched + other.mismatched
        out.token_mismatches = self.token_mismatches + other.token_mismatches
        for name in ("unverifiable", "skipped"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(out, name, {k: mine.get(k, 0) + theirs.get(k, 0) for k in {*mine, *theirs}})
        out.max_error = {k: max(self.max_error.get(k, 0.0), other.max_error.get(k, 0.0))
                         for k in {*self.max_error, *other.max_error}}
        return out


def layout_for(spec: ModelSpec, layout_id: str, block_size: int) -> KVLayout | None:
    """The KV layout of ``spec`` named ``layout_id`` (whatever its dtype), or None."""
    for dtype in DTYPE_BYTES:
        layout = KVLayout.from_spec(spec, dtype, block_size)
        if layout.layout_id == layout_id:
            return layout
    return None


def verify_store(store: StorageBackend, model_dir: str | Path, *,
                 sample: int | None = DEFAULT_SAMPLE, seed: int = 0,
                 keys: Sequence[BlockKey] | None = None, layout: KVLayout | None = None,
                 dtype: str | None = None, tolerance: Mapping[str, float] | None = None,
                 cpu_kernels: bool = True, device: str = "cpu", chunk_tokens: int = 512,
                 progress: bool = False) -> VerifyReport:
    """Audit ``store``'s blocks of one KV layout of the model in ``model_dir``.

    ``keys``: the blocks to choose from (default: every stored block; Mooncake Store cannot
    list its objects, so it needs them). ``sample`` of them are picked with ``seed`` (None:
    all), each checked with its whole chain. ``layout``: the store's (default: its own, or
    the one its keys name). ``dtype``: the compute dtype (default: the KV dtype).
    ``tolerance``: per KV dtype, over ``TOLERANCE``.
    """
    spec, mid = load_spec(model_dir), model_id(model_dir)
    listed = list(keys) if keys is not None else sorted(store.stored_keys(), key=_name)
    layout = layout or getattr(store, "layout", None) or _layout_of(listed, spec, mid,
                                                                    store.block_bytes)
    tolerances = {**TOLERANCE, **(tolerance or {})}
    report = VerifyReport(mid, [layout.layout_id] if layout else [], num_blocks=len(listed),
                          tolerance=tolerances)
    ours = []
    for key in listed:
        reason = ("other_model" if key.model_id != mid else
                  "other_layout" if layout is None or (key.layout_id, key.block_size) !=
                  (layout.layout_id, layout.block_size) else None)
        if reason:
            report.skipped[reason] = report.skipped.get(reason, 0) + 1
        else:
            ours.append(key)
    chosen = ours if sample is None or sample >= len(ours) else random.Random(seed).sample(
        ours, sample)
    report.num_sampled = len(chosen)
    if chosen and layout is not None:
        audit = _Audit(store, spec, layout, KeySpace(mid, layout.layout_id, layout.block_size))
        audit.run(chosen, model_dir, dtype or layout.dtype, cpu_kernels, device, chunk_tokens,
                  progress)
        audit.tally(report, tolerances[layout.dtype])
    return report


def verify_fs_root(root: str | Path, model_dir: str | Path, **options: Any) -> VerifyReport:
    """Audit the ``fs`` store at ``root``: every KV layout of the model found there (each
    with ``verify_store``'s ``options``), in one report."""
    from dualpath.storage.fs import FsStore, keys_under

    if not Path(root).is_dir():
        raise StorageError(f"no fs store at {root}")
    spec, mid = load_spec(model_dir), model_id(model_dir)
    groups: dict[tuple[str, str, int], list[BlockKey]] = {}
    for key in keys_under(root):
        groups.setdefault((key.model_id, key.layout_id, key.block_size), []).append(key)
    report = VerifyReport(mid, tolerance={**TOLERANCE, **(options.get("tolerance") or {})})
    for (model, layout_id, block_size), keys in sorted(groups.items()):
        layout = layout_for(spec, layout_id, block_size) if model == mid else None
        if layout is None:
            reason = "other_model" if model != mid else "other_layout"
            report.num_blocks += len(keys)
            report.skipped[reason] = report.skipped.get(reason, 0) + len(keys)
            continue
        with FsStore(root, layout, workers=1) as store:
            report = report.merge(verify_store(store, model_dir, keys=sorted(keys, key=_name),
                                               **options))
    return report


def _name(key: BlockKey) -> str:
    return key.name


def _layout_of(keys: Iterable[BlockKey], spec: ModelSpec, mid: str,
               block_bytes: int) -> KVLayout | None:
    """The layout of the first of the model's keys whose blocks are ``block_bytes`` long."""
    for key in keys:
        layout = layout_for(spec, key.layout_id, key.block_size) if key.model_id == mid else None
        if layout is not None and layout.full_block_bytes == block_bytes:
            return layout
    return None


class _Audit:
    """The chains of one layout's sampled blocks, their token checks and KV comparisons."""

    def __init__(self, store: StorageBackend, spec: ModelSpec, layout: KVLayout,
                 space: KeySpace) -> None:
        self.store, self.spec, self.layout, self.space = store, spec, layout, space
        self.stored: dict[bytes, BlockKey | None] = {}  # read_block's answer per hash
        # per block: kind, then the key's name (compared, token mismatch) or why it is
        # unverifiable, and for a compared block its error and the layer of it
        self.status: dict[bytes, tuple[str, str, float, int]] = {}
        self.max_blocks = max(1, spec.max_position // layout.block_size)
        self.salted_roots: set[bytes] = set()  # roots whose keys need a salt to check

    def run(self, chosen: Sequence[BlockKey], model_dir: str | Path, dtype: str,
            cpu_kernels: bool, device: str, chunk_tokens: int, progress: bool) -> None:
        """Walk and check every sampled block's chain, then recompute the chains."""
        plans = []
        for key in chosen:
            chain = self._chain(key)
            if isinstance(chain, str):
                self._set(key, _UNVERIFIABLE, chain)
                continue
            usable = self._check_tokens(chain)
            if usable < len(chain):
                why = "no_token_ids" if chain[-1].token_ids is None else "chain_unverifiable"
                self._set(key, _UNVERIFIABLE, why)
            if usable:
                plans.append(chain[:usable])
        if not plans:
            return
        from dualpath.storage.recompute import Recomputer, load_for_audit

        # sorted, a chain that is the prefix of another comes just before one that extends
        # it: drop it (the longer one checks its blocks), and shared prefixes run once
        plans.sort(key=lambda chain: [b.block_hash for b in chain])
        plans = [p for p, after in zip(plans, [*plans[1:], None], strict=True)
                 if after is None or after[: len(p)] != p]
        model = load_for_audit(model_dir, self.spec, dtype, self.layout.dtype, device,
                               cpu_kernels)
        recomputer = Recomputer(model, self.spec, self.layout, max(map(len, plans)), device,
                                chunk_tokens)
        for chain in tqdm(plans, desc="verify", unit="chain", disable=not progress):
            if all(b.block_hash in self.status for b in chain):
                continue
            recomputer.prefill([b.block_hash for b in chain],
                               [t for b in chain for t in b.token_ids or ()])
            for k, block in enumerate(chain):
                if block.block_hash not in self.status:
                    self._compare(block, recomputer, k)

    def tally(self, report: VerifyReport, tolerance: float) -> None:
        """Count every status into ``report``."""
        report.num_salted_roots += len(self.salted_roots)
        dtype = self.layout.dtype
        for kind, what, error, layer in self.status.values():
            if kind == _UNVERIFIABLE:
                report.num_unverifiable += 1
                report.unverifiable[what] = report.unverifiable.get(what, 0) + 1
            elif kind == _TOKENS:
                report.num_token_mismatches += 1
                report.token_mismatches.append(what)
            elif error > tolerance:
                report.num_checked += 1
                report.num_mismatched += 1
                report.mismatched.append({"key": what, "error": error, "layer": layer})
            else:
                report.num_checked += 1
                report.num_ok += 1
                report.max_error[dtype] = max(report.max_error.get(dtype, 0.0), error)

    # -- steps --------------------------------------------------------------------------------
    def _chain(self, key: BlockKey) -> list[BlockKey] | str:
        """``key``'s chain as stored, root first, or why it cannot be walked."""
        chain: list[BlockKey] = []
        current: BlockKey | None = key
        while current is not None:
            if current.block_hash not in self.stored:
                self.stored[current.block_hash] = self.store.read_block(current)
            found = self.stored[current.block_hash]
            if found is None:
                return "unreadable" if current is key else "broken_chain"
            chain.append(found)
            if len(chain) > self.max_blocks:
                return "chain_too_long"  # longer than the model's context (or a cycle)
            current = None if found.parent is None else self.space.key(found.parent, None)
        chain.reverse()
        return chain

    def _check_tokens(self, chain: list[BlockKey]) -> int:
        """How many leading blocks of ``chain`` have token ids that hash to their keys; the
        first whose ids do not is a token mismatch. A root whose ids do not hash under the
        unsalted seed may be a tenant's salted chain (``cache_salt``): the salt is not stored,
        so its key cannot be checked; it is counted in ``salted_roots`` and the chain goes on
        from it (every later block hashes from its parent, salt or not; the KV of all of them
        is compared)."""
        parent = root_hash(self.space.seed)
        for k, block in enumerate(chain):
            if block.token_ids is None:
                return k
            if k == 0 and block_hash(parent, block.token_ids) != block.block_hash:
                self.salted_roots.add(block.block_hash)
            elif block_hash(parent, block.token_ids) != block.block_hash:
                self._set(block, _TOKENS, block.name)
                return k
            parent = block.block_hash
        return len(chain)

    def _compare(self, block: BlockKey, recomputer: Any, k: int) -> None:
        import torch

        from dualpath.kv.cache import TORCH_DTYPES
        from dualpath.storage.recompute import relative_error

        buffer = torch.empty(self.layout.full_block_bytes, dtype=torch.uint8)
        if self.store.read_block(block, buffer) is None:
            self._set(block, _UNVERIFIABLE, "unreadable")
            return
        layers, tokens, _ = self.layout.full_block_shape
        stored = buffer.view(TORCH_DTYPES[self.layout.dtype]).view(layers, tokens, -1)
        error, layer = relative_error(stored, recomputer.block(k))
        self.status[block.block_hash] = (_COMPARED, block.name, error, layer)

    def _set(self, block: BlockKey, kind: str, what: str) -> None:
        self.status.setdefault(block.block_hash, (kind, what, 0.0, 0))
