"""Linear layers whose weights are prepacked for oneDNN on the CPU.

``torch.nn.functional.linear`` on the CPU reorders its weight into oneDNN's blocked layout on
every call (bf16) or runs MKL's plain GEMM (fp32). Packing once, when the model is ready,
and calling oneDNN's linear on the packed weight is what inference engines on the CPU do.
Measured on one core of a 2-core AMD EPYC (avx512_bf16), weights out of cache as in a real
forward: 1.8-2.1× faster at 1 row and 1.3× at 32 rows in bf16, with results bit-identical to
``F.linear``; 1.6-2.4× in fp32, within fp32 rounding of it (another summation order).

``Linear`` is an ``nn.Linear`` until ``pack()`` is called; packing replaces the weight: the
dense matrix is dropped (``weight`` becomes None) and only the packed one is kept, so a packed
model holds every weight once (keeping both cost 545 MB of RSS for SmolLM2 in fp32). Load
weights before packing; ``dense_weight()`` reads a packed weight back for checks.
"""

from __future__ import annotations

import torch
from torch import nn

PACK_DTYPES = (torch.float32, torch.bfloat16)
PACK_ROWS_HINT = 64  # the batch size oneDNN tunes the packed layout for (1..128 measured alike)


def can_pack(weight: torch.Tensor) -> bool:
    """True when ``weight`` can be prepacked here (a CPU tensor of a packable dtype, with
    oneDNN present)."""
    if weight.device.type != "cpu" or weight.dtype not in PACK_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` reordered for ``packed_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with a weight from ``pack_weight`` (``x``: ``[rows, in]``)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` that runs on a prepacked weight, and holds only that, once ``pack()`` has
    been called."""

    packed: torch.Tensor | None = None

    def pack(self) -> bool:
        """Prepack the weight in place of the dense one (which is dropped); False if it cannot
        be packed here, and the module stays a plain linear. Call once the weight is final."""
        if self.packed is not None:
            return True
        if not can_pack(self.weight):
            return False
        self.packed = pack_weight(self.weight)
        self.register_parameter("weight", None)  # the dense matrix goes (no second copy)
        return True

    def dense_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` as a dense tensor (a new one when it is packed)."""
        return self.weight if self.packed is None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is None:
            return nn.functional.linear(x, self.weight, self.bias)
        if x.dim() == 2:
            return packed_linear(x, packed, self.bias)
        flat = packed_linear(x.reshape(-1, x.shape[-1]), packed, self.bias)
        return flat.view(*x.shape[:-1], flat.shape[-1])
