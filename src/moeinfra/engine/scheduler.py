"""Iteration-level (continuous) batching for one rank, as vLLM v1 and SGLang schedule.

Every step has a token budget (``max_num_batched_tokens``). Running requests go first, each taking
what it still needs — one token when decoding (plus its draft tokens to verify, with speculative
decoding), the next chunk of its prompt when its prefill was cut (chunked prefill). Then waiting requests are admitted in arrival order, each starting after the
blocks the prefix cache already holds (and after KV preloaded from elsewhere: a prefill unit's
transfer, the on-disk cache), while the budget, ``max_num_seqs`` and free KV blocks allow.

Out of KV memory: a running request that cannot grow preempts the most recently admitted running
request (its blocks are freed, it goes back to the front of the queue and is recomputed later —
vLLM's recompute policy); a waiting request is admitted only if its blocks fit (refuse, never
over-commit). A prompt that could not fit even in an empty cache is finished with reason ``"length"``
instead of waiting forever. Nothing a running request has written is ever overwritten.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from moeinfra.engine.kv_blocks import BlockManager
from moeinfra.engine.sequence import Sequence, Status
from moeinfra.errors import InputError


@dataclass(frozen=True)
class Scheduled:
    """``seq`` runs ``length`` tokens from position ``start`` this step; the last
    ``len(drafts)`` of them are draft tokens to verify (speculative decoding)."""

    seq: Sequence
    start: int
    length: int
    drafts: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """This chunk reaches the sequence's last token, so the step samples its next one."""
        return self.start + self.length - len(self.drafts) == self.seq.num_tokens


class Scheduler:
    """Which requests of this rank run in the next step, and how many tokens each."""

    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        resume_alignment: int = 1,
    ) -> None:
        if max_num_seqs < 1:
            raise InputError(f"max_num_seqs={max_num_seqs} must be >= 1")
        if max_num_batched_tokens < 1:
            raise InputError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= 1")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # preloaded KV is used up to a multiple of this (a model that rebuilds its own state
        # only at block boundaries recomputes the rest)
        self.resume_alignment = resume_alignment
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Scheduled], list[Sequence]]:
        """The next step's chunks, and the requests finished here (prompt can never fit)."""
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        rejected: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            needed = seq.num_tokens - seq.num_computed
            drafts = tuple(seq.drafts[: budget - 1]) if needed == 1 else ()
            length = min(needed + len(drafts), budget)
            while not self.blocks.ensure_slots(seq.seq_id, seq.num_computed + length):
                if drafts:  # drop the drafts before preempting anyone for them
                    drafts, length = (), min(needed, budget)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                out.append(Scheduled(seq, seq.num_computed, length, drafts))
                budget -= length
                i += 1
                continue
            break  # ``seq`` itself was preempted: nothing after it is running any more
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if -(-seq.num_tokens // self.blocks.block_size) > self.blocks.num_blocks:
                self.waiting.popleft()
                rejected.append(seq)
                continue
            # a request whose prompt log-probabilities are wanted computes its whole prompt
            fresh = seq.computes_prompt_logprobs
            cached = self.blocks.allocate_prefix(seq.seq_id, seq.token_ids, use_cache=not fresh)
            if fresh:
                seq.preloaded = None
            start = self._preloaded_start(seq, cached)
            needed = seq.num_tokens - start
            # a request handed off with its first drafts verifies them in its first step here
            drafts = tuple(seq.drafts[: budget - 1]) if needed == 1 else ()
            length = min(needed + len(drafts), budget)
            if drafts and not self.blocks.ensure_slots(seq.seq_id, start + length):
                drafts, length = (), min(needed, budget)
            if not self.blocks.ensure_slots(seq.seq_id, start + length):
                self.blocks.free(seq.seq_id)
                break
            self.waiting.popleft()
            seq.status, seq.num_computed, seq.num_cached = Status.RUNNING, start, start
            if seq.scheduled_s is None:
                seq.scheduled_s = time.perf_counter()
            self.running.append(seq)
            out.append(Scheduled(seq, start, length, drafts))
            budget -= length
        return out, rejected

    def _preloaded_start(self, seq: Sequence, cached: int) -> int:
        """Where computing starts: after the cached prefix, or after preloaded KV that continues it
        (at least one token is always left to compute). Unusable preloaded KV is dropped."""
        pre = seq.preloaded
        if pre is None:
            return cached
        if not pre.start <= cached < pre.end:
            seq.preloaded = None
            return cached
        pre.write_from = cached
        start = min(pre.end, seq.num_tokens - 1)
        return max(cached, start - start % self.resume_alignment)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.drafts = []
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a request (finished or aborted) wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
