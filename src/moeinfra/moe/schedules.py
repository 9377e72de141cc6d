"""Overlap schedules as data: the order of one rank's compute and communication ops.

An op is ``(kind, micro_batch, layer)``. Compute kinds: ``ATTN`` (whole attention + gate), ``ATTN0``
(MLA down/up projections, RoPE), ``ATTN1`` (core attention, output projection, MoE norm and gate),
``SHARED`` (shared expert), ``MLP`` (routed experts on the received tokens). Communication kinds:
``DISPATCH`` and ``COMBINE``, issued asynchronously; the runtime waits for one only just before the
first compute op that needs its result (``MLP`` for a dispatch, the next layer's attention — or the
end — for a combine).

* ``none``: one micro-batch, every exchange waited at once.
* ``prefill``: DeepSeek's prefill order per layer, compute
  ``ATTN(mb1) | SHARED(mb0) | ATTN(mb0) | MLP(mb1) | MLP(mb0) | SHARED(mb1)`` while
  ``COMBINE(mb0) | DISPATCH(mb1) | DISPATCH(mb0) | COMBINE(mb1)`` are in flight.
* ``decode``: the 5-stage pipeline, compute slots ``SHARED | ATTN0 | MLP | ATTN1`` alternating
  micro-batches, ``DISPATCH`` after ``ATTN1`` and ``COMBINE`` after ``MLP`` of the same micro-batch.

Both overlapped schedules are generated the same way: walk a periodic pattern of compute slots; a slot
runs when it is its micro-batch's next compute op (otherwise it is skipped, which yields the
pipeline's fill and drain), followed by the exchange that op enables.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from moeinfra.errors import InputError

MODES = ("none", "prefill", "decode")
COMM_KINDS = ("DISPATCH", "COMBINE")


class Op(NamedTuple):
    kind: str
    micro_batch: int
    layer: int

    def __str__(self) -> str:
        return f"{self.kind}(mb{self.micro_batch})L{self.layer}"


# Per mode: compute ops of one micro-batch in one layer (chain order), and the periodic slot pattern.
_CHAINS = {
    "prefill": ("ATTN", "MLP", "SHARED"),
    "decode": ("ATTN0", "ATTN1", "SHARED", "MLP"),
}
_PATTERNS = {
    "prefill": (("ATTN", 1), ("SHARED", 0), ("ATTN", 0), ("MLP", 1), ("MLP", 0), ("SHARED", 1)),
    "decode": (
        ("SHARED", 0),
        ("ATTN0", 1),
        ("MLP", 0),
        ("ATTN1", 1),
        ("SHARED", 1),
        ("ATTN0", 0),
        ("MLP", 1),
        ("ATTN1", 0),
    ),
}
_ISSUES = {"ATTN": "DISPATCH", "ATTN1": "DISPATCH", "MLP": "COMBINE"}


@functools.cache
def schedule(mode: str, num_layers: int) -> tuple[Op, ...]:
    """The op order of ``mode`` for ``num_layers`` layers (same on every rank)."""
    return tuple(_schedule(mode, num_layers))


def _schedule(mode: str, num_layers: int) -> list[Op]:
    if mode not in MODES:
        raise InputError(f"overlap={mode!r} is not allowed; use one of {', '.join(MODES)}")
    if num_layers < 1:
        raise InputError(f"num_layers={num_layers} must be >= 1")
    if mode == "none":
        ops: list[Op] = []
        for layer in range(num_layers):
            ops += [Op(k, 0, layer) for k in ("ATTN", "SHARED", "DISPATCH", "MLP", "COMBINE")]
        return ops
    chain, pattern = _CHAINS[mode], _PATTERNS[mode]
    total = len(chain) * num_layers
    done = [0, 0]  # compute ops done per micro-batch
    ops = []
    while done[0] < total or done[1] < total:
        for kind, mb in pattern:
            step = done[mb]
            if step < total and chain[step % len(chain)] == kind:
                layer = step // len(chain)
                ops.append(Op(kind, mb, layer))
                if kind in _ISSUES:
                    ops.append(Op(_ISSUES[kind], mb, layer))
                done[mb] += 1
    return ops


def micro_batches(mode: str) -> int:
    return 1 if mode == "none" else 2
