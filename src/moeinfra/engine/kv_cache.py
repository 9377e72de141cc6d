"""The paged KV cache's memory: one tensor of cache slots per layer, and one step's view of it.

What a slot holds is the architecture's :class:`KVLayout` (DeepSeek-V3: the MLA latent, ``kv_lora_rank +
qk_rope_head_dim`` values per token per layer — not per-head keys and values). Which slots a sequence
owns is :class:`~moeinfra.engine.kv_blocks.BlockManager`'s bookkeeping; a step hands the model a
:class:`StepCache` mapping each running sequence to the slots of its positions.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch

from moeinfra.errors import InputError


@dataclass(frozen=True)
class KVLayout:
    """Per-token, per-layer cache contents of an architecture: named widths (values) and dtype."""

    parts: tuple[tuple[str, int], ...]
    num_layers: int
    dtype: torch.dtype = torch.float32

    @property
    def values_per_token(self) -> int:
        """Values cached per token per layer."""
        return sum(width for _, width in self.parts)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of cache per token over all layers."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return self.values_per_token * self.num_layers * itemsize


class PagedKVCache:
    """``num_blocks * block_size`` slots per layer of ``layout``: ``data [layers, slots, values]``."""

    def __init__(
        self, layout: KVLayout, num_blocks: int, block_size: int, device: str = "cpu"
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise InputError(
                f"num_blocks={num_blocks} and block_size={block_size} must both be >= 1"
            )
        self.layout, self.num_blocks, self.block_size = layout, num_blocks, block_size
        shape = (layout.num_layers, num_blocks * block_size, layout.values_per_token)
        if torch.device(device).type == "cpu":
            self.data = zeros_on_first_write(shape, layout.dtype)
        else:
            self.data = torch.zeros(shape, dtype=layout.dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def part(self, layer: int, name: str) -> torch.Tensor:
        """``[slots, width]`` view of one named part of ``layer``."""
        start = 0
        for part, width in self.layout.parts:
            if part == name:
                return self.data[layer, :, start : start + width]
            start += width
        raise InputError(f"part={name!r} is not one of {[p for p, _ in self.layout.parts]}")


def zeros_on_first_write(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose memory the OS commits page by page as it is first written (an
    anonymous private mapping reads as zeros until then; ``torch.zeros`` writes every page): a
    cache sized from memory costs what its requests fill, as a GPU's would not."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # keeps ``pages``


@dataclass
class StepCache:
    """One step's view: ``slots[seq]`` is the ``[capacity]`` int64 cache slot of each position of
    sequence ``seq`` (from its block table). ``plans`` memoises per-segment-list attention metadata
    (the same for every layer of the step)."""

    cache: PagedKVCache
    slots: dict[int, torch.Tensor]
    plans: dict = field(default_factory=dict)

    def layer(self, layer: int) -> LayerCache:
        return LayerCache(self, layer)

    def plan(self, segments: tuple, build):
        """``build(self, segments)``, computed once per step for the same segments."""
        if segments not in self.plans:
            self.plans[segments] = build(self, list(segments))
        return self.plans[segments]

    @staticmethod
    def slots_of(block_table: list[int], block_size: int, device=None) -> torch.Tensor:
        """``[len(block_table) * block_size]`` slot of every position the blocks hold."""
        blocks = torch.tensor(block_table, dtype=torch.int64, device=device)
        offsets = torch.arange(block_size, device=device)
        return (blocks[:, None] * block_size + offsets).reshape(-1)


@dataclass
class LayerCache:
    """What one layer's attention reads and writes in a step."""

    step: StepCache
    index: int

    def part(self, name: str) -> torch.Tensor:
        return self.step.cache.part(self.index, name)

    def rows(self) -> torch.Tensor:
        """``[slots, values]``: every part of this layer's slots, in the layout's order."""
        return self.step.cache.data[self.index]


def gather(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``rows[slots]``: ``[*slots.shape, values]`` cache rows of ``slots`` (any shape) — by
    ``index_select``, 5-10x faster on the CPU than advanced indexing for cache-sized gathers
    (torch 2.13; 0.17 vs 1.0 ms for 16k rows of 72 values)."""
    return rows.index_select(0, slots.reshape(-1)).view(*slots.shape, rows.shape[-1])
