"""``dualpath store verify``: recompute sampled stored chains and compare their KV (docs/design.md
§9).

For each sampled block the audit walks the chain back to its root through the stored parent
hashes, checks the stored token ids hash to each key (else a *token mismatch*; the root's under
the seed hash stored with it, so a salted root is checked without its salt and told from an
unsalted root under a wrong key), prefills the chain's tokens with the model (``recompute.py``;
one load for every chain) and compares stored and recomputed KV two ways: the largest
``||stored - recomputed|| / ||recomputed||`` over the block's layers (``TOLERANCE``), and the
largest error of one token's K or V (``TOKEN_TOLERANCE``, ``recompute.token_error``), so one
overwritten token is not diluted among the block's. Either above its KV dtype's tolerance is a
*mismatch*. A block saved without token ids, one whose chain holds such a block or a token
mismatch, and one missing or damaged (or with such an ancestor) is *unverifiable*, counted by
reason, never an error.

A block of the audited model in a layout the audit cannot recompute (``UNCHECKABLE``: vLLM's,
or a layout of other sizes) is *uncheckable*: counted by reason, and the audit fails, since it
did not check what it was asked to. Blocks of another model are *skipped* (that model's audit
checks them); a store with blocks, none of them the model's, fails too.

What it proves, and the measurements behind the tolerances: docs/derivations.md,
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
from dualpath.kv.hashing import BlockKey, KeySpace, block_hash
from dualpath.kv.layout import KVLayout, key_space_for
from dualpath.model.spec import DTYPE_BYTES, ModelSpec, load_spec, model_id
from dualpath.storage.base import StorageBackend

TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
# One token's K or V (recompute.token_error). Saved and recomputed here: at most 1.0e-5 in
# float32 and 0.096 in bfloat16 (SmolLM2, 2,570 tokens, the torch ops against the C kernels);
# a token's K overwritten by another token's: 1.26 or more (tiny models), by its neighbour's in
# the same block: 0.28 at the 1st percentile, 0.54 median (SmolLM2).
TOKEN_TOLERANCE = {"float32": 1e-2, "bfloat16": 0.3, "float16": 0.3}
DEFAULT_SAMPLE = 64
_COMPARED, _TOKENS, _UNVERIFIABLE = "compared", "token_mismatch", "unverifiable"
# Why a block of the audited model could not be checked at all (the audit then fails).
UNCHECKABLE = {
    "vllm_layout": "vLLM's CPU cache layout (KVLayout.vllm_layout_id): each of vLLM's "
                   "attention kernels (vec, vec16, amx, neon, ...) packs a block's keys its "
                   "own way, and the layout id does not say which one wrote them, so the "
                   "stored bytes cannot be laid out from recomputed KV",
    "other_layout": "a KV layout of the model that the audit does not know (other sizes "
                    "than the checkpoint's, or an unknown layout id)",
}
NO_BLOCKS_OF_MODEL = "the store holds blocks, none of them this model's (another --model?)"


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
    num_salted_roots: int = 0  # roots whose stored seed hash is a tenant's salted one
    num_untagged_roots: int = 0  # roots without a seed hash (older code) that fail the unsalted
    token_mismatches: list[str] = field(default_factory=list)  # key names
    num_unverifiable: int = 0
    unverifiable: dict[str, int] = field(default_factory=dict)  # reason -> blocks
    num_uncheckable: int = 0  # blocks of the model in a layout the audit cannot recompute
    uncheckable: dict[str, int] = field(default_factory=dict)  # reason (UNCHECKABLE) -> blocks
    skipped: dict[str, int] = field(default_factory=dict)  # other_model -> blocks
    max_error: dict[str, float] = field(default_factory=dict)  # per KV dtype, over ok blocks
    max_token_error: dict[str, float] = field(default_factory=dict)  # the same, per token
    tolerance: dict[str, float] = field(default_factory=dict)
    token_tolerance: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No mismatched KV, no token ids that fail their key, no block of the model left
        unchecked for its layout, and not a store of only other models' blocks."""
        return not self.failures()

    def failures(self) -> list[str]:
        """Why the audit fails, one line per reason (none: it passed)."""
        lines = []
        if self.num_mismatched:
            lines.append(f"{_blocks(self.num_mismatched)} whose KV is not their tokens'")
        if self.num_token_mismatches:
            lines.append(f"{_blocks(self.num_token_mismatches)} whose token ids do not hash to "
                         "their key")
        lines += [f"{_blocks(count)} could not be checked: {UNCHECKABLE[reason]}"
                  for reason, count in sorted(self.uncheckable.items())]
        if self.num_blocks and self.skipped.get("other_model", 0) == self.num_blocks:
            lines.append(f"{_blocks(self.num_blocks)} skipped: {NO_BLOCKS_OF_MODEL}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data."""
        return {**asdict(self), "ok": self.ok, "failures": self.failures()}

    def merge(self, other: VerifyReport) -> VerifyReport:
        """This report and ``other`` (another layout of the same store) as one."""
        out = VerifyReport(self.model_id, self.layouts + other.layouts,
                           tolerance={**self.tolerance, **other.tolerance},
                           token_tolerance={**self.token_tolerance, **other.token_tolerance})
        for name in ("num_blocks", "num_sampled", "num_checked", "num_ok", "num_mismatched",
                     "num_token_mismatches", "num_unverifiable", "num_uncheckable",
                     "num_salted_roots", "num_untagged_roots"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.mismatched = self.mismatched + other.mismatched
        out.token_mismatches = self.token_mismatches + other.token_mismatches
        for name in ("unverifiable", "uncheckable", "skipped"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(out, name, {k: mine.get(k, 0) + theirs.get(k, 0) for k in {*mine, *theirs}})
        for name in ("max_error", "max_token_error"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(out, name, {k: max(mine.get(k, 0.0), theirs.get(k, 0.0))
                                for k in {*mine, *theirs}})
        return out


def _blocks(count: int) -> str:
    return f"{count} block" if count == 1 else f"{count} blocks"


def layout_for(spec: ModelSpec, layout_id: str, block_size: int) -> KVLayout | None:
    """The KV layout of ``spec`` named ``layout_id`` (whatever its dtype), or None."""
    for dtype in DTYPE_BYTES:
        layout = KVLayout.from_spec(spec, dtype, block_size)
        if layout.layout_id == layout_id:
            return layout
    return None


def uncheckable_reason(spec: ModelSpec, layout_id: str, block_size: int) -> str:
    """Why blocks of ``spec`` under ``layout_id`` (not one ``layout_for`` knows) cannot be
    checked: a key of ``UNCHECKABLE``."""
    vllm_ids = {KVLayout.from_spec(spec, dtype, block_size).vllm_layout_id
                for dtype in DTYPE_BYTES}
    return "vllm_layout" if layout_id in vllm_ids else "other_layout"


def verify_store(store: StorageBackend, model_dir: str | Path, *,
                 sample: int | None = DEFAULT_SAMPLE, seed: int = 0,
                 keys: Sequence[BlockKey] | None = None, layout: KVLayout | None = None,
                 dtype: str | None = None, tolerance: Mapping[str, float] | None = None,
                 token_tolerance: Mapping[str, float] | None = None,
                 cpu_kernels: bool = True, device: str = "cpu", chunk_tokens: int = 512,
                 progress: bool = False) -> VerifyReport:
    """Audit ``store``'s blocks of one KV layout of the model in ``model_dir``.

    ``keys``: the blocks to choose from (default: every stored block; Mooncake Store cannot
    list its objects, so it needs them). ``sample`` of them are picked with ``seed`` (None:
    all), each checked with its whole chain. ``layout``: the store's (default: its own, or
    the one its keys name). ``dtype``: the compute dtype (default: the KV dtype).
    ``tolerance``, ``token_tolerance``: per KV dtype, over ``TOLERANCE`` and
    ``TOKEN_TOLERANCE``. The model's blocks of another layout are uncheckable (the audit
    fails); other models' are skipped.
    """
    spec, mid = load_spec(model_dir), model_id(model_dir)
    listed = list(keys) if keys is not None else sorted(store.stored_keys(), key=_name)
    layout = layout or getattr(store, "layout", None) or _layout_of(listed, spec, mid,
                                                                    store.block_bytes)
    tolerances = {**TOLERANCE, **(tolerance or {})}
    token_tolerances = {**TOKEN_TOLERANCE, **(token_tolerance or {})}
    report = VerifyReport(mid, [layout.layout_id] if layout else [], num_blocks=len(listed),
                          tolerance=tolerances, token_tolerance=token_tolerances)
    ours = []
    for key in listed:
        if key.model_id != mid:
            report.skipped["other_model"] = report.skipped.get("other_model", 0) + 1
        elif layout is None or (key.layout_id, key.block_size) != (layout.layout_id,
                                                                   layout.block_size):
            _count_uncheckable(report, uncheckable_reason(spec, key.layout_id,
                                                          key.block_size), 1)
        else:
            ours.append(key)
    chosen = ours if sample is None or sample >= len(ours) else random.Random(seed).sample(
        ours, sample)
    report.num_sampled = len(chosen)
    if chosen and layout is not None:
        audit = _Audit(store, spec, layout, key_space_for(mid, layout))
        audit.run(chosen, model_dir, dtype or layout.dtype, cpu_kernels, device, chunk_tokens,
                  progress)
        audit.tally(report, tolerances[layout.dtype], token_tolerances[layout.dtype])
    return report


def _count_uncheckable(report: VerifyReport, reason: str, count: int) -> None:
    report.num_uncheckable += count
    report.uncheckable[reason] = report.uncheckable.get(reason, 0) + count


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
    report = VerifyReport(mid, tolerance={**TOLERANCE, **(options.get("tolerance") or {})},
                          token_tolerance={**TOKEN_TOLERANCE,
                                           **(options.get("token_tolerance") or {})})
    for (model, layout_id, block_size), keys in sorted(groups.items()):
        layout = layout_for(spec, layout_id, block_size) if model == mid else None
        if layout is None:
            report.num_blocks += len(keys)
            if model != mid:
                report.skipped["other_model"] = report.skipped.get("other_model", 0) + len(keys)
            else:
                _count_uncheckable(report, uncheckable_reason(spec, layout_id, block_size),
                                   len(keys))
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


@dataclass(frozen=True)
class _Status:
    """What the audit found for one block: its kind, the key's name (compared, token
    mismatch) or why it is unverifiable, and for a compared block its errors and where."""

    kind: str
    what: str
    error: float = 0.0  # the largest per-layer relative error ...
    layer: int = 0  # ... and its layer
    token_error: float = 0.0  # the largest error of one token's K or V ...
    token_layer: int = 0  # ... its layer ...
    token: int = 0  # ... and its token in the block


class _Audit:
    """The chains of one layout's sampled blocks, their token checks and KV comparisons."""

    def __init__(self, store: StorageBackend, spec: ModelSpec, layout: KVLayout,
                 space: KeySpace) -> None:
        self.store, self.spec, self.layout, self.space = store, spec, layout, space
        self.stored: dict[bytes, BlockKey | None] = {}  # read_block's answer per hash
        self.status: dict[bytes, _Status] = {}
        self.max_blocks = max(1, spec.max_position // layout.block_size)
        self.salted_roots: set[bytes] = set()  # roots whose seed hash is a salted chain's
        self.untagged_roots: set[bytes] = set()  # roots without one that fail the unsalted

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

    def tally(self, report: VerifyReport, tolerance: float, token_tolerance: float) -> None:
        """Count every status into ``report``."""
        report.num_salted_roots += len(self.salted_roots)
        report.num_untagged_roots += len(self.untagged_roots)
        dtype = self.layout.dtype
        for status in self.status.values():
            if status.kind == _UNVERIFIABLE:
                report.num_unverifiable += 1
                report.unverifiable[status.what] = report.unverifiable.get(status.what, 0) + 1
            elif status.kind == _TOKENS:
                report.num_token_mismatches += 1
                report.token_mismatches.append(status.what)
            elif status.error > tolerance or status.token_error > token_tolerance:
                report.num_checked += 1
                report.num_mismatched += 1
                report.mismatched.append({
                    "key": status.what, "error": status.error, "layer": status.layer,
                    "token_error": status.token_error, "token_layer": status.token_layer,
                    "token": status.token})
            else:
                report.num_checked += 1
                report.num_ok += 1
                report.max_error[dtype] = max(report.max_error.get(dtype, 0.0), status.error)
                report.max_token_error[dtype] = max(report.max_token_error.get(dtype, 0.0),
                                                    status.token_error)

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
        first whose ids do not is a token mismatch. The root's ids hash from the seed hash
        stored with it (``BlockKey.seed_hash``): the unsalted space's, or a tenant's salted one
        (``cache_salt``; counted in ``salted_roots``: the salt itself is not stored, so which
        tenant's it is goes unchecked). A root stored without one (by older code) whose ids do
        not hash under the unsalted seed may be salted or under a wrong key: counted in
        ``untagged_roots``. Either way the chain goes on from it (every later block hashes
        from its parent, salt or not; the KV of all of them is compared)."""
        unsalted = self.space.seed_hash
        parent = unsalted
        for k, block in enumerate(chain):
            if block.token_ids is None:
                return k
            if k == 0 and block.seed_hash is not None:
                parent = block.seed_hash
            if block_hash(parent, block.token_ids) != block.block_hash:
                if k or block.seed_hash is not None:
                    self._set(block, _TOKENS, block.name)
                    return k
                self.untagged_roots.add(block.block_hash)
            elif k == 0 and parent != unsalted:
                self.salted_roots.add(block.block_hash)
            parent = block.block_hash
        return len(chain)

    def _compare(self, block: BlockKey, recomputer: Any, k: int) -> None:
        import torch

        from dualpath.kv.cache import TORCH_DTYPES
        from dualpath.storage.recompute import relative_error, token_error

        buffer = torch.empty(self.layout.full_block_bytes, dtype=torch.uint8)
        if self.store.read_block(block, buffer) is None:
            self._set(block, _UNVERIFIABLE, "unreadable")
            return
        layers, tokens, _ = self.layout.full_block_shape
        stored = buffer.view(TORCH_DTYPES[self.layout.dtype]).view(layers, tokens, -1)
        recomputed = recomputer.block(k)
        error, layer = relative_error(stored, recomputed)
        worst, worst_layer, token = token_error(stored, recomputed)
        self.status[block.block_hash] = _Status(_COMPARED, block.name, error, layer, worst,
                                                worst_layer, token)

    def _set(self, block: BlockKey, kind: str, what: str) -> None:
        self.status.setdefault(block.block_hash, _Status(kind, what))
