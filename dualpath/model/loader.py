"""Per-parameter weight loader for HF safetensors checkpoints.

Each checkpoint tensor is mapped to one of our parameters by name; q/k/v and gate/up tensors
land in their shard of the fused parameter. Every parameter must be filled exactly once, before
the CPU fast path packs the weights (packing replaces the dense parameters).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from dualpath.errors import ModelLoadError
from dualpath.model.dummy import dummy_settings, fill_random
from dualpath.model.llama import LlamaForCausalLM
from dualpath.model.spec import ModelSpec, load_spec

# checkpoint name part -> (fused name part, shard)
PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def _target(name: str) -> tuple[str, str | int | None]:
    for part, (fused, shard) in PACKED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _shard_rows(model: LlamaForCausalLM, name: str, shard: str | int) -> slice:
    if isinstance(shard, str):  # "model.layers.N.self_attn.qkv_proj.weight"
        return model.get_submodule(name.rsplit(".", 2)[0]).qkv_shard_rows(shard)
    size = model.spec.intermediate_size
    return slice(shard * size, (shard + 1) * size)


def _copy_param(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], name: str,
                tensor: torch.Tensor) -> str:
    target, shard = _target(name)
    if target not in params:
        raise ModelLoadError(f"checkpoint tensor {name!r} has no matching parameter")
    param = params[target]
    dest = param.data if shard is None else param.data[_shard_rows(model, target, shard)]
    if dest.shape != tensor.shape:
        raise ModelLoadError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
    dest.copy_(tensor)
    return target if shard is None else f"{target}#{shard}"


def _expected_keys(model: LlamaForCausalLM) -> set[str]:
    expected = set()
    for name, _ in model.named_parameters():
        if ".qkv_proj.weight" in name or ".qkv_proj.bias" in name:
            expected |= {f"{name}#{s}" for s in "qkv"}
        elif ".gate_up_proj." in name:
            expected |= {f"{name}#0", f"{name}#1"}
        else:
            expected.add(name)
    return expected


def load_weights(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    """Fill every parameter of ``model`` from the ``*.safetensors`` files of ``model_dir``.
    The model must not be packed yet (``pack_weights`` drops the dense weights it fills)."""
    if model.is_packed:
        raise ModelLoadError("the model's weights are packed for the CPU fast path; load "
                             "weights into a model before pack_weights / use_kernels")
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors file in {model_dir}")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith(SKIPPED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and model.lm_head is None:
                    continue
                loaded.add(_copy_param(model, params, name, f.get_tensor(name)))
    missing = _expected_keys(model) - loaded
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _materialize(model: torch.nn.Module, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> None:
    """Give every meta parameter and buffer uninitialized memory on ``device`` (in ``dtype``
    for floating-point ones, when given): the checkpoint, or random draws, fill it.

    ``Module.to_empty`` does the same through ``empty_like`` on meta tensors, whose reference
    implementation imports torch's symbolic-shape machinery: a second of every engine start.
    A parameter two modules share (tied weights) stays shared.
    """
    def empty(t: torch.Tensor) -> torch.Tensor:
        kind = dtype if dtype is not None and t.dtype.is_floating_point else t.dtype
        return torch.empty(t.shape, dtype=kind, device=device)

    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(empty(param),
                                                     requires_grad=param.requires_grad)
            setattr(module, name, made[id(param)])
        for name, buf in module.named_buffers(recurse=False):
            setattr(module, name, empty(buf))


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
               spec: ModelSpec | None = None, device: str = "cpu") -> LlamaForCausalLM:
    """Build the model for ``model_dir``'s config and load its weights in ``dtype`` (random
    ones drawn on ``device`` for a ``model/dummy.py`` folder)."""
    spec = spec or load_spec(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(spec)
    random = dummy_settings(model_dir)
    if random is not None:  # drawn in place on the device: no host copy of the weights
        _materialize(model, device, dtype)
        with torch.no_grad():
            fill_random(list(model.named_parameters()), int(random["seed"]), random["std"])
        return model.eval().requires_grad_(False)
    _materialize(model)
    load_weights(model, model_dir)
    model.to(dtype=dtype, device=device)
    return model.eval().requires_grad_(False)
