"""``EngineCore``: one rank of an engine unit — its requests, KV cache, scheduler, and its part of the
model (data-parallel attention, expert-parallel MoE).

:meth:`EngineCore.step` is collective over the unit's process group: every rank calls it once per
engine step, with the same overlap mode, even with no request of its own (its empty batch still
takes part in every MoE layer's dispatch and combine, as DeepSeek's data-parallel attention must).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from moeinfra.engine.checkpoint import CheckpointReader
from moeinfra.engine.config import EngineConfig
from moeinfra.engine.device import keeps_fp8, place_rank, resolve_dtype
from moeinfra.engine.drafting import MtpDrafter
from moeinfra.engine.handoff import Handoff, to_host
from moeinfra.engine.hf_config import ModelConfig, read_config
from moeinfra.engine.kv_blocks import BlockManager
from moeinfra.engine.kv_cache import PagedKVCache, StepCache
from moeinfra.engine.kv_capacity import describe as describe_capacity
from moeinfra.engine.kv_capacity import kv_capacity
from moeinfra.engine.logits_processing import bad_word_ids, process_logits
from moeinfra.engine.logprobs import gather, log_softmax
from moeinfra.engine.models.mtp import with_mtp_layer
from moeinfra.engine.outputs import StepOutput
from moeinfra.engine.registry import architecture
from moeinfra.engine.sampling import SamplingParams, StopChecker, request_generator, sample
from moeinfra.engine.scheduler import Scheduler
from moeinfra.engine.sequence import Preloaded, Sequence, Status
from moeinfra.engine.speculative import SpecStats, verify
from moeinfra.engine.structured import Grammars
from moeinfra.engine.tokenizer import DetokenizeStream, Tokenizer
from moeinfra.eplb import Plan, rebalance
from moeinfra.errors import InputError
from moeinfra.memory import keep_freed_memory
from moeinfra.moe import cpu_features, cpu_kernels
from moeinfra.moe.comm import Communicator
from moeinfra.moe.expert_parallel import take_step_loads
from moeinfra.moe.mla import Segment


def check_prompt(config: ModelConfig, prompt_ids: list[int]) -> None:
    """Raise :class:`InputError` for an empty prompt, an id outside the vocabulary, or a prompt
    that leaves no room in the model's context."""
    if not prompt_ids:
        raise InputError("prompt must have at least one token")
    vocab = config.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise InputError(f"prompt token ids must be in 0..{vocab - 1}")
    if len(prompt_ids) >= config.max_position_embeddings:
        raise InputError(
            f"prompt has {len(prompt_ids)} tokens, the model's context is "
            f"{config.max_position_embeddings}"
        )


@dataclass(frozen=True)
class StepStats:
    """One step of one rank: tokens run (prompt / recompute vs. one-token decode), the
    query-key pairs their attention covered, the rows sampled, queue sizes after scheduling, and
    seconds in the model's forward, in LM head + sampling, and in all."""

    prefill_tokens: int
    decode_tokens: int
    attended_keys: int
    sampled: int
    running: int
    waiting: int
    forward_s: float
    sample_s: float
    total_s: float

    @property
    def overhead_s(self) -> float:
        """Engine time outside the model: scheduling, inputs, outputs, detokenisation."""
        return self.total_s - self.forward_s - self.sample_s


# A CPU step's logits (and MTP draft logits) are computed and sampled in parts of about this many
# bytes (float32): glibc maps a tensor above 32 MB afresh every time (see ``keep_freed_memory``) —
# the 66 MB of 128 requests' logits made a decode step of the small benchmark checkpoint ~65 ms
# instead of ~50 — and parts just under 32 MB fragment its heap (resident memory 2.4 GB against
# 1.8 GB with 16 MB parts, after six 128-request greedy runs; 8 MB parts: 1.7 GB, 12% slower).
# Top-k / top-p sampling sorts a part: its int64 indices are twice its logits, still under 32 MB.
LOGITS_PART_BYTES = 16 << 20


class EngineCore:
    """One rank of a unit of ``comm.world_size`` ranks serving the checkpoint in ``model_dir``."""

    def __init__(
        self,
        model_dir: Path,
        config: EngineConfig | None = None,
        comm: Communicator | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.comm = comm or Communicator()
        model_dir = Path(model_dir)
        raw = read_config(model_dir)
        self.arch = architecture(raw["model_type"], str(model_dir / "config.json"))
        self.model_config: ModelConfig = self.arch.parse_config(raw, str(model_dir / "config.json"))
        if self.arch.check_block_size is not None:
            self.arch.check_block_size(self.model_config, self.config.block_size)
        self.tokenizer = tokenizer or Tokenizer(model_dir)
        self.plan = self._initial_plan()
        local_rank = os.environ.get("LOCAL_RANK")  # torchrun's; a spawned rank's is set already
        self.device = place_rank(self.config.device, local_rank and int(local_rank))
        self.dtype = dtype = resolve_dtype(self.config.dtype, self.device)
        if self.device.type == "cpu" and (note := cpu_features.half_precision_note(dtype)):
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        reader = CheckpointReader(model_dir)
        keep_fp8 = keeps_fp8(self.config.fp8_weights, self.device)
        self.model = self.arch.load(
            reader, self.model_config, self.plan, self.comm, dtype, keep_fp8=keep_fp8
        )
        self.model.to(self.device).eval()
        self.num_speculative_tokens = self.config.num_speculative_tokens
        self.drafter = (
            MtpDrafter(self, reader, dtype, keep_fp8) if self.num_speculative_tokens else None
        )
        self.mtp = self.drafter.mtp if self.drafter is not None else None
        self.spec_stats = SpecStats(self.num_speculative_tokens)
        layout = self.arch.kv_layout(self.model_config, dtype, self.config.block_size)
        if self.mtp is not None:
            layout = with_mtp_layer(layout)
        block_size = self.config.block_size
        per_block = layout.bytes_per_token * block_size
        host_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.comm.world_size))
        capacity = kv_capacity(self.config, per_block, self.device, host_ranks)
        if self.comm.rank == 0:
            print(f"moeinfra engine: {describe_capacity(capacity, block_size, per_block)}",
                  file=sys.stderr, flush=True)  # fmt: skip
        self.cache = PagedKVCache(layout, capacity.blocks, block_size, self.device)
        resume = self.config.block_size
        if self.arch.resume_tokens is not None:
            resume = self.arch.resume_tokens(self.model_config, self.config.block_size)
        self.blocks = BlockManager(
            capacity.blocks,
            self.config.block_size,
            reuse_last_block=self.mtp is None,
            prefix_blocks=resume // self.config.block_size,
        )
        self.scheduler = Scheduler(
            self.blocks,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            resume_alignment=resume if self.arch.resume_tokens is not None else 1,
        )
        if hasattr(self.model, "release"):
            self.blocks.on_free.append(self.model.release)
        self.requests: dict[str, Sequence] = {}
        self._detok: dict[str, DetokenizeStream] = {}
        self._ids = itertools.count()
        self.steps = 0
        self.rebalances = 0
        # per step, [moe layers, experts] routed copies, kept on the device until a plan needs them
        self.load_window: deque[torch.Tensor] = deque(maxlen=self.config.eplb_window)
        self.stats: deque[StepStats] = deque(maxlen=4096)
        self.handoffs: list[Handoff] = []
        # (prompt ids, *prompt_kv) of requests that ended at their first token, collected when
        # set to a list (a unit writing them to its on-disk prefix cache)
        self.ended_at_prefill: list[tuple[list[int], torch.Tensor, object]] | None = None
        self._slot_cache: dict[int, tuple[list[int], torch.Tensor]] = {}
        for layer in self.model.moe:
            layer.record_load = True
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        if self.device.type == "cpu":
            keep_freed_memory()  # once loaded: the loader's large temporaries went back already
            cpu_kernels.available()  # built now (first time on a machine), not in a request's step

    # ------------------------------------------------------------------ placement
    def _initial_plan(self, num_layers: int | None = None) -> Plan:
        """Experts placed evenly over the unit's slots, for ``num_layers`` MoE layers (default:
        the model's)."""
        mc, world = self.model_config, self.comm.world_size
        layers = mc.num_moe_layers if num_layers is None else num_layers
        experts = mc.block.num_routed_experts
        slots = experts + self.config.redundant_experts
        if slots % world:
            raise InputError(
                f"redundant_experts={self.config.redundant_experts}: {experts} experts + redundant "
                f"must be a multiple of ranks={world}"
            )
        load = np.ones((max(layers, 1), experts))
        groups = mc.block.num_expert_groups
        return rebalance(load[:layers], slots, groups, 1, world)

    @torch.no_grad()
    def warm_up(self, seed: int = 0) -> int:
        """Run the model once on a prompt of random tokens as long as a step's token budget (as
        far as the cache and the context allow), then on one decode token after it, and forget
        both (collective on the unit, like :meth:`step`). What a first forward pays once — the
        weights packed for oneDNN, its kernels for the step's shapes, the allocator's first pages
        — is then paid here, not by the first requests a server admits (vLLM's dummy run). No
        request, statistic, expert load or prefix-cache entry is left behind. Returns the prompt
        length run."""
        bs = self.blocks.block_size
        room = (self.blocks.num_free_blocks - 1) * bs
        length = min(
            self.config.max_num_batched_tokens, self.model_config.max_position_embeddings - 1, room
        )
        if length < 1:
            return 0
        seq_id = -1  # real requests number from 0
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(self.model_config.vocab_size, (length + 1,), generator=generator)
        counters = (self.blocks.queried_tokens, self.blocks.hit_tokens)
        self.blocks.allocate_prefix(seq_id, [0])  # one token: nothing of the cache is matched
        try:
            self.blocks.ensure_slots(seq_id, length + 1)
            table = self.blocks.block_table(seq_id)
            slots = {seq_id: StepCache.slots_of(table, bs, self.device)}
            for start, count, prefill in ((0, length, True), (length, 1, False)):
                segments = [Segment(seq_id, start, count)]
                step_cache = StepCache(self.cache, slots)
                hidden = self.model(
                    ids[start : start + count].to(self.device),
                    segments,
                    step_cache,
                    self.overlap_mode(prefill),
                )
                self.model.logits(hidden[-1:])
        finally:
            self.blocks.free(seq_id)
            self.blocks.queried_tokens, self.blocks.hit_tokens = counters
            if self.model_config.num_moe_layers:
                take_step_loads(self.model.moe)  # the warm-up's routing is no load to balance
        return length

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        *,
        output_ids: list[int] | None = None,
        preloaded: Preloaded | None = None,
        handoff: object = None,
        drafts: list[int] | None = None,
    ) -> None:
        """Queue a request of this rank (``prompt_ids`` already tokenised).

        A request prefilled elsewhere comes with the tokens it already generated (``output_ids``,
        not emitted again), the prompt's KV (``preloaded``) and, from a drafting unit, the MTP
        layer's ``drafts`` after its last token; a prefix read from the on-disk cache comes as
        ``preloaded`` alone. With ``handoff`` set, the request stops here after its first
        token and its prompt KV is queued in :attr:`handoffs` for a decode unit.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InputError(f"request_id={request_id!r} is already running")
        check_prompt(self.model_config, prompt_ids)
        vocab = self.model_config.vocab_size
        for name, ids in (("output_ids", output_ids), ("drafts", drafts)):
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise InputError(f"{name} must be token ids in 0..{vocab - 1}")
        if params.max_token_id() >= vocab:
            raise InputError(
                f"token id {params.max_token_id()} in stop_token_ids, allowed_token_ids or "
                f"logit_bias is outside the vocabulary (0..{vocab - 1})"
            )
        seq = Sequence(
            next(self._ids),
            request_id,
            list(prompt_ids),
            params,
            generator=request_generator(params.seed, self.device),
            stop_checker=StopChecker(params.stop, params.include_stop_str_in_output)
            if params.stop
            else None,
            preloaded=preloaded,
            handoff=handoff,
            bad_word_ids=bad_word_ids(self.tokenizer, params.bad_words),
        )
        detok = DetokenizeStream(self.tokenizer, params.skip_special_tokens)
        if params.grammar is not None:
            seq.grammar = self._grammar(params, list(output_ids or ()))
        if output_ids:
            seq.output_ids = list(output_ids)
            text = detok.push(output_ids)
            seq.text = seq.stop_checker.check(text)[0] if seq.stop_checker else text
        if drafts and self.mtp is not None:
            seq.drafts = list(drafts[: self.num_speculative_tokens])
        self.requests[request_id] = seq
        self._detok[request_id] = detok
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> StepOutput | None:
        """Stop a request now and free its blocks; None if it is not (any more) on this rank."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort")
        return self._output(seq, [], "")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def has_prefill(self) -> bool:
        """A request of this rank still has prompt (or recompute) tokens to run."""
        return any(s.num_tokens - s.num_computed > 1 for s in self.scheduler.running) or bool(
            self.scheduler.waiting
        )

    # ------------------------------------------------------------------ the step
    def overlap_mode(self, any_prefill: bool) -> str:
        if self.config.overlap != "auto":
            return self.config.overlap
        if self.comm.world_size == 1:
            return "none"
        return "prefill" if any_prefill else "decode"

    @torch.no_grad()
    def step(self, overlap: str | None = None) -> list[StepOutput]:
        """Run one engine step (collective on the unit); outputs of the requests it advanced."""
        began = time.perf_counter()
        scheduled, rejected = self.scheduler.schedule()
        outputs = []
        for seq in rejected:
            self._finish(seq, "length")
            outputs.append(self._output(seq, [], ""))
        if overlap is None:
            overlap = self.overlap_mode(any(c.length > 1 for c in scheduled))
        for c in scheduled:
            if c.seq.preloaded is not None:
                self._write_preloaded(c.seq, c.start)
        segments = [Segment(c.seq.seq_id, c.start, c.length) for c in scheduled]
        ids = []
        for c in scheduled:
            seq = c.seq
            if c.length == 1 and seq.output_ids and c.start == seq.num_tokens - 1:
                ids.append(seq.output_ids[-1])
            else:
                ids.extend(seq.token_ids[c.start : c.start + c.length - len(c.drafts)])
                ids.extend(c.drafts)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        step_cache = StepCache(self.cache, {c.seq.seq_id: self._slots(c.seq) for c in scheduled})
        forward_began = time.perf_counter()
        hidden = self.model(input_ids, segments, step_cache, overlap)
        forward_s = time.perf_counter() - forward_began
        self.steps += 1
        if self.model_config.num_moe_layers:
            self.load_window.append(take_step_loads(self.model.moe))
        interval = self.config.eplb_interval
        if interval is not None and self.steps % interval == 0:
            self.rebalance()
        starts = np.cumsum([0] + [c.length for c in scheduled])
        for c, first in zip(scheduled, starts, strict=False):
            if c.seq.computes_prompt_logprobs:
                self._prompt_logprobs(c, int(first), hidden)
        sampling = [
            (c, int(start)) for c, start in zip(scheduled, starts, strict=False) if c.samples
        ]
        for c in scheduled:
            if not c.drafts:  # a verified request's computed positions are known after verify
                self._computed(c.seq, c.start, c.start + c.length)
        sample_s = 0.0
        handoffs = []
        if sampling:
            sample_began = time.perf_counter()
            new_tokens, new_logprobs = self._sample(hidden, sampling)
            sample_s = time.perf_counter() - sample_began
            for (c, _), tokens, logprobs in zip(sampling, new_tokens, new_logprobs, strict=True):
                seq = c.seq
                if c.drafts:
                    accepted = len(tokens) - 1
                    self._computed(seq, c.start, c.start + 1 + accepted, seq.token_ids + tokens)
                    self.spec_stats.record(len(c.drafts), accepted)
                    seq.num_draft_tokens += len(c.drafts)
                    seq.num_accepted_tokens += accepted
                seq.drafts = []
                outputs.append(self._append_all(seq, tokens, logprobs))
                if seq.handoff is not None and not seq.finished:
                    handoffs.append(seq)
        if self.drafter is not None:
            sampled = {c.seq.seq_id for c, _ in sampling}
            self.drafter.draft(scheduled, starts, hidden, step_cache, sampled)
        for seq in handoffs:
            self._hand_off(seq)
        self.stats.append(
            StepStats(
                prefill_tokens=sum(
                    c.length
                    for c in scheduled
                    if not c.seq.output_ids or c.length > 1 + len(c.drafts)
                ),
                decode_tokens=sum(
                    c.length
                    for c in scheduled
                    if c.seq.output_ids and c.length == 1 + len(c.drafts)
                ),
                attended_keys=sum(
                    c.length * c.start + c.length * (c.length + 1) // 2 for c in scheduled
                ),
                sampled=len(sampling),
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                forward_s=forward_s,
                sample_s=sample_s,
                total_s=time.perf_counter() - began,
            )
        )
        return outputs

    def _computed(
        self, seq: Sequence, start: int, end: int, token_ids: list[int] | None = None
    ) -> None:
        """Positions ``start .. end - 1`` of ``seq`` now have KV in the cache (``token_ids``: its
        tokens, when accepted drafts are not appended yet)."""
        seq.num_computed = end
        bs = self.blocks.block_size
        # a block becomes shareable once full: only then is there something to register
        if self.config.enable_prefix_caching and end // bs > start // bs:
            self.blocks.mark_computed(seq.seq_id, token_ids or seq.token_ids, end)

    def _prompt_logprobs(self, c, first: int, hidden: torch.Tensor) -> None:
        """Gather the log-probabilities of the prompt tokens chunk ``c`` (rows from ``first`` of
        ``hidden``) predicts, after those its request already has (CPU: in parts, as
        :meth:`_sample`)."""
        seq = c.seq
        lo = max(c.start, len(seq.prompt_logprobs))  # position p predicts prompt token p + 1
        hi = min(c.start + c.length, len(seq.prompt_ids) - 1)
        top = seq.params.prompt_logprobs
        step = self._logits_rows_per_part() if hidden.device.type == "cpu" else hi - lo
        for p in range(lo, hi, max(step, 1)):
            end = min(p + max(step, 1), hi)
            rows = hidden[first + p - c.start : first + end - c.start]
            targets = seq.prompt_ids[p + 1 : end + 1]
            raw = log_softmax(self.model.logits(rows))
            seq.prompt_logprobs += gather(raw, targets, [top] * len(targets))

    def _sample(self, hidden: torch.Tensor, sampling: list) -> tuple[list, list]:
        """New tokens of each sampled chunk ``(chunk, first row)``: one drawn token, or the
        accepted drafts and the target's token of a chunk with drafts (:func:`verify`), and their
        :class:`Logprobs` (None for a request that asked for none). On the CPU in parts of about
        :data:`LOGITS_PART_BYTES` of float32 logits (a chunk's rows stay in one part, however
        many)."""
        if hidden.device.type != "cpu":
            return self._sample_part(hidden, sampling)
        most = self._logits_rows_per_part()
        tokens, logprobs, part, rows = [], [], [], 0
        for c, first in sampling:
            if part and rows + len(c.drafts) + 1 > most:
                done = self._sample_part(hidden, part)
                tokens, logprobs = tokens + done[0], logprobs + done[1]
                part, rows = [], 0
            part.append((c, first))
            rows += len(c.drafts) + 1
        if part:
            done = self._sample_part(hidden, part)
            tokens, logprobs = tokens + done[0], logprobs + done[1]
        return tokens, logprobs

    def _logits_rows_per_part(self) -> int:
        return max(1, LOGITS_PART_BYTES // (4 * self.model_config.vocab_size))

    def _sample_part(self, hidden: torch.Tensor, sampling: list) -> tuple[list, list]:
        """:meth:`_sample` of the chunks ``sampling``, their logits as one tensor."""
        rows, where = [], []
        for c, first in sampling:
            last = first + c.length - 1
            where.append(len(rows))
            rows.extend(range(last - len(c.drafts), last + 1))
        logits = self.model.logits(hidden[rows])
        for (c, _), at in zip(sampling, where, strict=True):
            if c.seq.grammar is not None:  # (a request with a grammar verifies no drafts)
                c.seq.grammar.mask(logits[at])
        wanted = [i for i, (c, _) in enumerate(sampling) if c.seq.params.logprobs is not None]
        raw = None
        if wanted:  # before the logits are processed in place
            span = [where[i] + j for i in wanted for j in range(len(sampling[i][0].drafts) + 1)]
            raw = log_softmax(logits[span])
        processed = []
        for (c, _), at in zip(sampling, where, strict=True):
            seq = c.seq
            if seq.params.processes_logits or len(seq.output_ids) < seq.params.min_tokens:
                made = seq.output_ids
                processed += [
                    (at + j, seq, made + list(c.drafts[:j])) for j in range(len(c.drafts) + 1)
                ]
        if processed:
            process_logits(logits, processed, self.eos_token_ids)
        plain = [i for i, (c, _) in enumerate(sampling) if not c.drafts]
        out: list[list[int]] = [[] for _ in sampling]
        if plain:
            seqs = [sampling[i][0].seq for i in plain]
            # no request verifies drafts: every row is sampled (no copy of a [rows, vocab] tensor)
            rows_of_plain = logits if len(plain) == len(rows) else logits[[where[i] for i in plain]]
            tokens = sample(
                rows_of_plain,
                [s.params for s in seqs],
                [s.generator for s in seqs],
                [len(s.output_ids) for s in seqs],
            ).tolist()
            for i, token in zip(plain, tokens, strict=True):
                out[i] = [token]
        for i, (c, _) in enumerate(sampling):
            if c.drafts:
                seq, at = c.seq, where[i]
                span = logits[at : at + len(c.drafts) + 1]
                out[i] = verify(span, c.drafts, seq.params, seq.generator, len(seq.output_ids))
        logprobs: list = [None] * len(sampling)
        offset = 0
        for i in wanted:
            made, top = out[i], sampling[i][0].seq.params.logprobs
            logprobs[i] = gather(raw[offset : offset + len(made)], made, [top] * len(made))
            offset += len(sampling[i][0].drafts) + 1
        return out, logprobs

    def _slots(self, seq: Sequence) -> torch.Tensor:
        """``[capacity]`` cache slot of every position of ``seq`` (rebuilt when its table grows)."""
        table = self.blocks.block_table(seq.seq_id)
        cached = self._slot_cache.get(seq.seq_id)
        if cached is None or cached[0] != table:
            cached = (table, StepCache.slots_of(table, self.blocks.block_size, self.device))
            self._slot_cache[seq.seq_id] = cached
        return cached[1]

    def _write_preloaded(self, seq: Sequence, end: int) -> None:
        """Copy preloaded KV of positions ``write_from .. end - 1`` into ``seq``'s slots."""
        pre = seq.preloaded
        slots = self._slots(seq)[pre.write_from : end]
        rows = pre.kv[:, pre.write_from - pre.start : end - pre.start]
        self.cache.data[:, slots] = rows.to(self.device, self.cache.data.dtype)
        seq.preloaded = None

    def prompt_kv(self, seq: Sequence) -> tuple[torch.Tensor, object]:
        """:func:`~moeinfra.engine.handoff.to_host` of ``seq``'s prompt KV
        (``[layers, prompt tokens, values]``)."""
        return to_host(self.cache.data[:, self._slots(seq)[: len(seq.prompt_ids)]])

    def _hand_off(self, seq: Sequence) -> None:
        kv, ready = self.prompt_kv(seq)
        self.handoffs.append(
            Handoff(
                seq.request_id,
                seq.prompt_ids,
                list(seq.output_ids),
                seq.params,
                kv,
                seq.num_cached,
                seq.handoff,
                list(seq.drafts),
                ready,
            )
        )
        self._finish(seq, "handoff")

    def _grammar(self, params: SamplingParams, output_ids: list[int]):
        """The matcher of a request's grammar having followed ``output_ids`` (those after its
        ``grammar_after``), or None while that has not been generated yet."""
        if params.grammar_after is None:
            return self.grammars.matcher(params.grammar, output_ids)
        decode = self.tokenizer.decode
        for k in range(len(output_ids) + 1):
            if params.grammar_after in decode(output_ids[:k], params.skip_special_tokens):
                return self.grammars.matcher(params.grammar, output_ids[k:])
        return None

    def _append_all(self, seq: Sequence, tokens: list[int], logprobs=None) -> StepOutput:
        """:meth:`_append` each token until the request finishes; one output for them all (with
        their ``logprobs``, and the prompt's on the request's first output)."""
        new_ids, new_text = [], ""
        for token in tokens:
            out = self._append(seq, token)
            new_ids += out.new_token_ids
            new_text += out.new_text
            if seq.finished:
                break
        out = msgspec.structs.replace(out, new_token_ids=new_ids, new_text=new_text)
        if logprobs is not None:
            out.logprobs = logprobs[: len(new_ids)]
        if len(seq.output_ids) == len(new_ids):  # the request's first tokens
            out.queued_s = (seq.scheduled_s or seq.arrived_s) - seq.arrived_s
            if seq.params.prompt_logprobs is not None:
                out.prompt_logprobs = seq.prompt_logprobs
        return out

    def _append(self, seq: Sequence, token: int) -> StepOutput:
        seq.output_ids.append(token)
        params = seq.params
        reason = None
        if token in params.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        detok = self._detok[seq.request_id]
        # a stop token's own text is not part of the output unless asked for (as in vLLM)
        shows = reason is None or params.include_stop_str_in_output
        new_text = detok.push([token]) if shows else ""
        if seq.grammar is not None:
            if seq.grammar.advance(token) and reason is None:
                reason = "stop"  # the grammar is complete
        elif params.grammar is not None and new_text:
            # the thinking ended: its marker is in the new text or straddles it (only that end
            # of the text is searched, not the whole output every step)
            window = detok.text[-(len(new_text) + len(params.grammar_after) - 1) :]
            if params.grammar_after in window:
                seq.grammar = self.grammars.matcher(params.grammar, [])
        full = detok.text
        if seq.stop_checker is not None:
            shown, stopped = seq.stop_checker.check(full)
            new_text = shown[len(seq.text) :]
            if stopped and reason is None:
                reason = "stop"
                seq.stop_reason = min(
                    (s for s in params.stop if s in full), key=full.index, default=None
                )
            seq.text = shown
        else:
            seq.text += new_text
        if (
            reason is None
            and params.max_tokens is not None
            and len(seq.output_ids) >= params.max_tokens
        ):
            reason = "length"
        if reason is None and seq.num_tokens >= self.model_config.max_position_embeddings:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)
        return self._output(seq, [token], new_text)

    def _finish(self, seq: Sequence, reason: str) -> None:
        ended = reason not in ("abort", "handoff") and len(seq.output_ids) == 1
        if self.ended_at_prefill is not None and ended:
            # (lm-eval's loglikelihood requests end here: their shared contexts are worth keeping;
            # a hand-off's prompt is written where it is sent)
            self.ended_at_prefill.append((seq.prompt_ids, *self.prompt_kv(seq)))
        self.scheduler.finish(seq)
        self._slot_cache.pop(seq.seq_id, None)
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)
        self._detok.pop(seq.request_id, None)

    def _output(self, seq: Sequence, new_ids: list[int], new_text: str) -> StepOutput:
        return StepOutput(
            seq.request_id,
            new_ids,
            new_text,
            seq.status is Status.FINISHED,
            seq.finish_reason,
            seq.stop_reason,
            seq.num_cached,
            seq.num_draft_tokens,
            seq.num_accepted_tokens,
        )

    # ------------------------------------------------------------------ expert rebalancing
    def window_load(self) -> np.ndarray | None:
        """``[moe layers, experts]`` int64 routed copies of this rank's last ``eplb_window`` steps
        (None before any step)."""
        if not self.load_window:
            return None
        return torch.stack(list(self.load_window)).sum(0).cpu().numpy()

    def rebalance(self) -> int:
        """Re-place experts from the loads of the last ``eplb_window`` steps (summed over ranks)
        and migrate their weights live (collective). Returns the expert tensors this rank received."""
        if not self.load_window:
            return 0
        load = torch.stack(list(self.load_window)).sum(0)  # on the device: NCCL reduces only there
        if self.comm.distributed and self.comm.world_size > 1:
            dist.all_reduce(load, group=self.comm.group)
        load = load.cpu().numpy()
        lay = self.plan.layout
        plan = rebalance(load, lay.num_replicas, lay.num_groups, lay.num_nodes, lay.num_gpus)
        received = self.model.decoder.apply_plan(plan)
        self.plan = self.model.plan = plan
        self.rebalances += 1
        return received
