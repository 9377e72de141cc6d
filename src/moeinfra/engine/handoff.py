"""What a prefill-only request leaves for its decode unit after its first token: the
:class:`Handoff` record, and its prompt's KV in host memory (where a KV connector,
:mod:`moeinfra.server.kv_connector`, or the on-disk prefix cache takes it from)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeinfra.engine.sampling import SamplingParams


@dataclass
class Handoff:
    """A prefill-only request after its first token: what its decode unit needs to go on.

    ``kv [layers, prompt tokens, values]``: the prompt's KV in the cache layout (the MTP layer's
    included when the unit drafts), in host memory once ``ready`` (a CUDA event its copy from the
    device completes at; None: already there); ``target``: the ``handoff`` the request was added
    with; ``drafts``: the MTP layer's drafts after the first token (empty without speculative
    decoding)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    kv: torch.Tensor
    num_cached_tokens: int
    target: object
    drafts: list[int] = field(default_factory=list)
    ready: object = None


def to_host(rows: torch.Tensor) -> tuple[torch.Tensor, object]:
    """``rows`` (a copy gathered from the paged cache) in host memory, and the CUDA event its copy
    from the device completes at (None: there already): on a GPU the copy runs while the next step
    does."""
    if rows.device.type != "cuda":
        return rows, None
    kv = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    kv.copy_(rows, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return kv, ready
