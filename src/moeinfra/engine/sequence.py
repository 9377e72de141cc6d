"""One request's state inside a rank's engine: its tokens, how many have KV in the cache, its status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from moeinfra.engine.sampling import SamplingParams, StopChecker


@dataclass
class Preloaded:
    """KV of positions ``start .. start + kv.shape[1] - 1`` computed elsewhere (a prefill unit, the
    on-disk prefix cache): ``kv [layers, tokens, values]`` in the cache layout. Written into the
    sequence's slots from ``write_from`` (what the in-memory prefix cache lacks) when it is admitted."""

    start: int
    kv: torch.Tensor
    write_from: int = 0

    @property
    def end(self) -> int:
        return self.start + self.kv.shape[1]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request on one rank.

    ``num_computed``: leading tokens of ``token_ids`` whose KV is in the cache; the next step feeds
    ``token_ids[num_computed:]`` (or a chunk of it). ``num_cached``: prompt tokens that came from the
    prefix cache when the request was (last) admitted. ``text``: output text exposed so far (stop
    strings withheld / cut). ``preloaded``: KV to write instead of computing (consumed at
    admission). ``handoff``: where a prefill-only request's KV goes after its first token (opaque to
    the engine; None: decode here). ``drafts``: tokens the MTP layer proposed after the last one,
    verified by the next step; ``num_draft_tokens`` / ``num_accepted_tokens``: its drafts so far.
    ``bad_word_ids``: its ``bad_words`` as token ids; ``prompt_logprobs``: those gathered so far
    (for prompt tokens 1, 2, ...) when its parameters ask for them; ``arrived_s`` /
    ``scheduled_s``: ``time.perf_counter()`` when it was added and first scheduled.
    """

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    stop_checker: StopChecker | None = None
    preemptions: int = 0
    preloaded: Preloaded | None = None
    handoff: object = None
    drafts: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    prompt_logprobs: list = field(default_factory=list)
    grammar: object = None  # its structured-output matcher (engine.structured.Grammar)
    arrived_s: float = field(default_factory=time.perf_counter)
    scheduled_s: float | None = None  # when a step first ran it

    @cached_property
    def prompt_token_set(self) -> np.ndarray:
        """The distinct prompt tokens, sorted (int64; what the repetition penalty covers)."""
        return np.unique(np.asarray(self.prompt_ids, dtype=np.int64))

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are still to be computed here: it takes no prefix
        from a cache (computed positions give no logits)."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
