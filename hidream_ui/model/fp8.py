"""fp8 storage of the transformer (`--weights fp8`): linear weights kept as float8_e4m3fn, computed in
the compute dtype, through diffusers' layerwise-casting hooks.

Which modules: every `nn.Linear` of the transformer (attention projections, MoE experts, the
shared expert, adaLN modulations, caption projections) except those matching `SKIP_PATTERNS`:
the embedders (timestep, pooled text, patch, rope), norms, the MoE gate (a plain parameter, never
cast) and the final layer stay in the compute dtype, as do E1-Full's LoRA weights.

Loading (`load_streamed`) fills an empty (meta) model one tensor at a time, each cast to its
storage dtype as it is read, so the host never holds a bf16 copy of an fp8 transformer: the
resident bytes are about half of bf16 (tests/test_plans.py measures it in RSS).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from hidream_ui.model.errors import ModelError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from hidream_ui.device.backends import DeviceInfo

SKIP_PATTERNS: tuple[str, ...] = ("embedder", "norm", r"(^|\.)gate$", "final_layer", "lora_")
STORAGE_DTYPE_NAME = "float8_e4m3fn"


def _skipped(name: str) -> bool:
    return any(re.search(pattern, name) for pattern in SKIP_PATTERNS)


def fp8_module_names(transformer: "torch.nn.Module") -> list[str]:
    """The modules whose weights fp8 stores (the same rule diffusers' hook applies with SKIP_PATTERNS)."""
    from diffusers.hooks._common import _GO_LC_SUPPORTED_PYTORCH_LAYERS

    names = []

    def walk(module, prefix: str) -> None:
        if prefix and _skipped(prefix):
            return
        if isinstance(module, _GO_LC_SUPPORTED_PYTORCH_LAYERS):
            names.append(prefix)
            return
        for child_name, child in module.named_children():
            walk(child, f"{prefix}.{child_name}" if prefix else child_name)

    walk(transformer, "")
    return names


def fp8_parameter_names(transformer: "torch.nn.Module") -> set[str]:
    modules = dict(transformer.named_modules())
    return {f"{name}.{p}" for name in fp8_module_names(transformer) for p, _ in modules[name].named_parameters()}


def fp8_unavailable(device: "DeviceInfo") -> str | None:
    """Why fp8 storage cannot be used on `device` (None when it can): a real round trip through
    float8_e4m3fn on the device. CPU and CUDA (any GPU: storage only, the maths runs in the compute
    dtype) pass with torch >= 2.1; on Ascend it depends on the torch_npu release (see README)."""
    import torch

    dtype = getattr(torch, STORAGE_DTYPE_NAME, None)
    if dtype is None:
        return f"torch {torch.__version__} has no {STORAGE_DTYPE_NAME} dtype (needs torch >= 2.1)"
    try:
        probe = torch.tensor([0.5, -2.0, 448.0], dtype=torch.float32, device=device.torch_device)
        back = probe.to(dtype).to(torch.float32).cpu()
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot hold fp8 here"; its text is the reason
        where = device.type
        if where == "npu":
            try:
                import torch_npu  # noqa: F401 - only for its version in the message

                where = f"torch_npu {torch_npu.__version__}"
            except ImportError:
                where = "torch_npu (not importable)"
        return f"{where} cannot hold {STORAGE_DTYPE_NAME} tensors on {device.torch_device}: {type(exc).__name__}: {exc}"
    if back.tolist() != [0.5, -2.0, 448.0]:
        return f"{device.torch_device} round-trips {STORAGE_DTYPE_NAME} wrongly: {back.tolist()}"
    return None


def apply_fp8(transformer: "torch.nn.Module", compute_dtype: "torch.dtype") -> None:
    """Installs diffusers' layerwise-casting hooks: fp8 at rest, `compute_dtype` inside each forward.
    Weights already loaded in fp8 (`load_streamed`) are not touched; bf16 ones are cast now."""
    import torch
    from diffusers.hooks import apply_layerwise_casting

    apply_layerwise_casting(
        transformer,
        storage_dtype=getattr(torch, STORAGE_DTYPE_NAME),
        compute_dtype=compute_dtype,
        skip_modules_pattern=SKIP_PATTERNS,
    )


def _strip_prefix(key: str) -> str:
    # ComfyUI-style checkpoints prefix every key; diffusers' single-file converter for HiDream strips the same.
    return key[len("model.diffusion_model.") :] if key.startswith("model.diffusion_model.") else key


def weight_files(source: Path) -> list[Path]:
    """The safetensors files of a transformer: a folder (sharded with an index, or one file) or one file."""
    source = Path(source)
    if source.is_file():
        return [source]
    index = source / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [source / shard for shard in shards]
    return [source / "diffusion_pytorch_model.safetensors"]


# safetensors dtype names -> torch dtype attribute names.
_SAFETENSORS_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def read_tensors(path: Path):
    """Yields (key, tensor) from a safetensors file one tensor at a time, each read into its own buffer.

    Not safe_open: its tensors are views of one mapping of the whole file, so every page read stays
    resident (and counted) while any tensor of the shard is alive; here only the tensor being cast is.
    """
    import torch

    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
        header.pop("__metadata__", None)
        start = 8 + size
        for key, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            handle.seek(start + begin)
            data = bytearray(handle.read(end - begin))
            dtype = getattr(torch, _SAFETENSORS_DTYPES[info["dtype"]])
            tensor = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            yield key, tensor.reshape(info["shape"])


_TRIM_EVERY = 64 << 20  # bytes read between two trims: keeps the load's peak near the fp8 bytes


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim, resolved once (find_library may run ldconfig); None where there is none."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


def _release_freed_memory() -> None:
    """Hands the read buffers glibc kept in its heap back to the OS (the bf16 bytes of every tensor passed
    through there); without it the process keeps ~a quarter of the bf16 size it no longer uses."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def load_streamed(
    config: dict,
    files: Iterable[Path],
    compute_dtype: "torch.dtype",
    *,
    fp8: bool,
    on_tensor: Callable[[str], None] | None = None,
) -> "torch.nn.Module":
    """A HiDream transformer filled tensor by tensor from `files` on the host: fp8 for the modules
    `fp8_module_names` picks (when `fp8`), `compute_dtype` for the rest. Raises ModelError naming
    missing or unexpected keys."""
    import torch
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from diffusers import HiDreamImageTransformer2DModel

    with init_empty_weights():
        transformer = HiDreamImageTransformer2DModel.from_config(config)
    storage = getattr(torch, STORAGE_DTYPE_NAME)
    low = fp8_parameter_names(transformer) if fp8 else set()
    expected = dict(transformer.named_parameters())
    seen: set[str] = set()
    unexpected: list[str] = []
    since_trim = 0
    for path in files:
        for key, tensor in read_tensors(path):
            since_trim += tensor.numel() * tensor.element_size()
            if since_trim > _TRIM_EVERY:
                _release_freed_memory()
                since_trim = 0
            name = _strip_prefix(key)
            if name not in expected:
                unexpected.append(key)
                continue
            value = tensor.to(storage if name in low else compute_dtype)
            set_module_tensor_to_device(transformer, name, "cpu", value=value, dtype=value.dtype)
            seen.add(name)
            if on_tensor is not None:
                on_tensor(name)
    missing = sorted(set(expected) - seen)
    if unexpected or missing:
        raise ModelError(
            f"transformer weights do not fit its config: {len(missing)} missing (e.g. {missing[:3]}), "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
    _release_freed_memory()
    meta = [name for name, b in transformer.named_buffers() if b.device.type == "meta"]
    if meta:
        raise ModelError(f"transformer buffers not initialised after loading: {meta[:3]}")
    return transformer.eval().requires_grad_(False)


__all__ = [
    "SKIP_PATTERNS",
    "apply_fp8",
    "fp8_module_names",
    "fp8_parameter_names",
    "fp8_unavailable",
    "load_streamed",
    "read_tensors",
    "weight_files",
]
