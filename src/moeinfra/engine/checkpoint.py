"""Read tensors of a Hugging Face safetensors checkpoint, memory-mapped, shard by shard.

A checkpoint is ``model.safetensors`` or shards listed by ``model.safetensors.index.json``
(``weight_map: {tensor name: shard file}``). Only the tensors asked for are read, so a rank reads its
own experts and nothing else. FP8 weights with a ``weight_scale_inv`` beside them (DeepSeek-V4's own
files: ``X.scale`` beside ``X.weight``) are dequantised by :meth:`CheckpointReader.get`, or read as
stored by :meth:`CheckpointReader.fp8` for a loader that keeps them in FP8; so are DeepSeek-V4's FP4
experts (int8, two E2M1 values per byte).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moeinfra.engine.fp8 import dequantize, dequantize_fp4
from moeinfra.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
# packed FP4 as DeepSeek-V4 stores it (int8), or torch's own two-per-byte dtype
FP4_DTYPES = tuple(t for t in (torch.int8, getattr(torch, "float4_e2m1fn_x2", None)) if t)


class CheckpointReader:
    """Tensors of the checkpoint in ``model_dir``, by name.

    Every error names the file and the tensor: a missing shard, a tensor absent from the index,
    a wrong shape.
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self._open: dict[str, object] = {}
        index = self.model_dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
            self.weight_map: dict[str, str] = dict(weight_map)
        elif (self.model_dir / SINGLE).is_file():
            self.weight_map = {name: SINGLE for name in self._keys(SINGLE)}
        else:
            raise CheckpointError(
                f"{self.model_dir}: no {INDEX} and no {SINGLE} (safetensors weights are required)"
            )
        for shard in sorted(set(self.weight_map.values())):
            if not (self.model_dir / shard).is_file():
                tensor = next(n for n, s in self.weight_map.items() if s == shard)
                raise CheckpointError(
                    f"{self.model_dir / shard}: shard missing (listed in {INDEX} for {tensor})"
                )

    def _keys(self, shard: str) -> list[str]:
        return list(self._file(shard).keys())

    def _file(self, shard: str):
        if shard not in self._open:
            try:
                self._open[shard] = safe_open(self.model_dir / shard, framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{self.model_dir / shard}: cannot be read ({exc})") from None
        return self._open[shard]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def _raw(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.model_dir}: tensor {name} is missing from the checkpoint")
        shard = self.weight_map[name]
        try:
            return self._file(shard).get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{self.model_dir / shard}: tensor {name}: {exc}") from None

    def scale_name(self, name: str) -> str:
        """The name of ``name``'s block scales: ``X.weight_scale_inv`` (transformers, DeepSeek-V3)
        or ``X.scale`` (DeepSeek-V4's own files)."""
        native = name.removesuffix(".weight") + ".scale"
        if name.endswith(".weight") and native in self.weight_map:
            return native
        return name + SCALE_SUFFIX

    def fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(weight, weight_scale_inv)`` as stored when ``name`` is an FP8 weight with its block
        scales, else None."""
        scale = self.scale_name(name)
        if name not in self.weight_map or scale not in self.weight_map:
            return None
        weight = self._raw(name)
        if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return None
        return weight, self._raw(scale).float()

    def get(
        self, name: str, shape: tuple[int, ...] | None = None, dtype=torch.float32
    ) -> torch.Tensor:
        """Tensor ``name`` as ``dtype`` (FP8 dequantised), checked against ``shape`` when given."""
        tensor = self._raw(name)
        fp4 = tensor.dtype in FP4_DTYPES and shape is not None and len(shape) == 2
        fp4 = fp4 and tensor.dim() == 2 and 2 * tensor.shape[1] == shape[1]
        if fp4 or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = self.scale_name(name)
            if scale not in self.weight_map:
                raise CheckpointError(
                    f"{self.model_dir / self.weight_map[name]}: tensor {name} is "
                    f"{'FP4' if fp4 else 'FP8'} but {scale} is missing"
                )
            try:
                if fp4:
                    tensor = dequantize_fp4(tensor, self._raw(scale), dtype=dtype)
                else:
                    tensor = dequantize(tensor, self._raw(scale).float(), dtype=dtype)
            except ValueError as exc:
                raise CheckpointError(
                    f"{self.model_dir / self.weight_map[name]}: tensor {name}: {exc}"
                ) from None
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.model_dir / self.weight_map[name]}: tensor {name} has shape "
                f"{list(tensor.shape)}, the config needs {list(shape)}"
            )
        return tensor.to(dtype)
