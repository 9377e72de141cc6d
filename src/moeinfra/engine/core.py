"""``EngineCore``: one rank of an engine unit — its requests, KV cache, scheduler, and its part of the
model (data-parallel attention, expert-parallel MoE).

:meth:`EngineCore.step` is collective over the unit's process group: every rank calls it once per
engine step, with the same overlap mode, even with no request of its own (its empty batch still
takes part in every MoE layer's dispatch and combine, as DeepSeek's data-parallel attention must).
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moeinfra.engine.checkpoint import CheckpointReader
from moeinfra.engine.config import EngineConfig
from moeinfra.engine.device import keeps_fp8, place_rank, resolve_dtype
from moeinfra.engine.hf_config import ModelConfig, read_config
from moeinfra.engine.kv_blocks import BlockManager
from moeinfra.engine.kv_cache import PagedKVCache, StepCache
from moeinfra.engine.registry import architecture
from moeinfra.engine.sampling import SamplingParams, StopChecker, request_generator, sample
from moeinfra.engine.scheduler import Scheduler
from moeinfra.engine.sequence import Preloaded, Sequence, Status
from moeinfra.engine.tokenizer import DetokenizeStream, Tokenizer
from moeinfra.eplb import Plan, rebalance
from moeinfra.errors import InputError
from moeinfra.moe.comm import Communicator
from moeinfra.moe.expert_parallel import take_step_loads
from moeinfra.moe.mla import Segment


@dataclass
class StepOutput:
    """What one step did for one request: its new tokens and text, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


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


@dataclass
class Handoff:
    """A prefill-only request after its first token: what its decode unit needs to go on.

    ``kv [layers, prompt tokens, values]``: the prompt's KV in the cache layout; ``target``: the
    ``handoff`` the request was added with."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    kv: torch.Tensor
    num_cached_tokens: int
    target: object


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
        self.tokenizer = tokenizer or Tokenizer(model_dir)
        self.plan = self._initial_plan()
        local_rank = os.environ.get("LOCAL_RANK")  # torchrun's; a spawned rank's is set already
        self.device = place_rank(self.config.device, local_rank and int(local_rank))
        self.dtype = dtype = resolve_dtype(self.config.dtype, self.device)
        self.model = self.arch.load(
            CheckpointReader(model_dir),
            self.model_config,
            self.plan,
            self.comm,
            dtype,
            keep_fp8=keeps_fp8(self.config.fp8_weights, self.device),
        )
        self.model.to(self.device).eval()
        layout = self.arch.kv_layout(self.model_config, dtype)
        self.cache = PagedKVCache(
            layout, self.config.num_kv_blocks, self.config.block_size, self.device
        )
        self.blocks = BlockManager(self.config.num_kv_blocks, self.config.block_size)
        self.scheduler = Scheduler(
            self.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens
        )
        self.requests: dict[str, Sequence] = {}
        self._detok: dict[str, DetokenizeStream] = {}
        self._ids = itertools.count()
        self.steps = 0
        self.rebalances = 0
        # per step, [moe layers, experts] routed copies, kept on the device until a plan needs them
        self.load_window: deque[torch.Tensor] = deque(maxlen=self.config.eplb_window)
        self.stats: deque[StepStats] = deque(maxlen=4096)
        self.handoffs: list[Handoff] = []
        self._slot_cache: dict[int, tuple[list[int], torch.Tensor]] = {}
        for layer in self.model.moe:
            layer.record_load = True
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    # ------------------------------------------------------------------ placement
    def _initial_plan(self) -> Plan:
        mc, world = self.model_config, self.comm.world_size
        experts = mc.block.num_routed_experts
        slots = experts + self.config.redundant_experts
        if slots % world:
            raise InputError(
                f"redundant_experts={self.config.redundant_experts}: {experts} experts + redundant "
                f"must be a multiple of ranks={world}"
            )
        load = np.ones((max(mc.num_moe_layers, 1), experts))
        groups = mc.block.num_expert_groups
        return rebalance(load[: mc.num_moe_layers], slots, groups, 1, world)

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
    ) -> None:
        """Queue a request of this rank (``prompt_ids`` already tokenised).

        A request prefilled elsewhere comes with the tokens it already generated (``output_ids``,
        not emitted again) and the prompt's KV (``preloaded``); a prefix read from the on-disk cache
        comes as ``preloaded`` alone. With ``handoff`` set, the request stops here after its first
        token and its prompt KV is queued in :attr:`handoffs` for a decode unit.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InputError(f"request_id={request_id!r} is already running")
        check_prompt(self.model_config, prompt_ids)
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
        )
        detok = DetokenizeStream(self.tokenizer)
        if output_ids:
            seq.output_ids = list(output_ids)
            text = detok.push(output_ids)
            seq.text = seq.stop_checker.check(text)[0] if seq.stop_checker else text
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
                ids.extend(seq.token_ids[c.start : c.start + c.length])
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
        ends = np.cumsum([c.length for c in scheduled]) - 1
        sampling = [(c, int(end)) for c, end in zip(scheduled, ends, strict=True) if c.samples]
        bs = self.blocks.block_size
        for c in scheduled:
            seq = c.seq
            seq.num_computed = c.start + c.length
            # a block becomes shareable once full: only then is there something to register
            if self.config.enable_prefix_caching and seq.num_computed // bs > c.start // bs:
                self.blocks.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed)
        sample_s = 0.0
        if sampling:
            sample_began = time.perf_counter()
            logits = self.model.logits(hidden[[row for _, row in sampling]])
            seqs = [c.seq for c, _ in sampling]
            self._mask_early_stop(logits, seqs)
            tokens = sample(
                logits,
                [s.params for s in seqs],
                [s.generator for s in seqs],
                [len(s.output_ids) for s in seqs],
            ).tolist()
            sample_s = time.perf_counter() - sample_began
            for seq, token in zip(seqs, tokens, strict=True):
                outputs.append(self._append(seq, token))
                if seq.handoff is not None and not seq.finished:
                    self._hand_off(seq)
        self.stats.append(
            StepStats(
                prefill_tokens=sum(
                    c.length for c in scheduled if not c.seq.output_ids or c.length > 1
                ),
                decode_tokens=sum(1 for c in scheduled if c.length == 1 and c.seq.output_ids),
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

    def prompt_kv(self, seq: Sequence) -> torch.Tensor:
        """``[layers, prompt tokens, values]`` copy of ``seq``'s prompt KV from the cache, in host
        memory (where a transfer or the on-disk cache takes it from)."""
        return self.cache.data[:, self._slots(seq)[: len(seq.prompt_ids)]].cpu()

    def _hand_off(self, seq: Sequence) -> None:
        self.handoffs.append(
            Handoff(
                seq.request_id,
                seq.prompt_ids,
                list(seq.output_ids),
                seq.params,
                self.prompt_kv(seq),
                seq.num_cached,
                seq.handoff,
            )
        )
        self._finish(seq, "handoff")

    def _mask_early_stop(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Before ``min_tokens`` outputs, EOS and stop tokens cannot be sampled (vLLM's rule)."""
        for row, seq in enumerate(seqs):
            if len(seq.output_ids) < seq.params.min_tokens:
                banned = set(seq.params.stop_token_ids or ())
                if not seq.params.ignore_eos:
                    banned |= self.eos_token_ids
                ids = [t for t in banned if t < logits.shape[1]]
                logits[row, ids] = float("-inf")

    def _append(self, seq: Sequence, token: int) -> StepOutput:
        seq.output_ids.append(token)
        params = seq.params
        new_text = self._detok[seq.request_id].push([token])
        full = self._detok[seq.request_id].text
        reason = None
        if token in (params.stop_token_ids or ()):
            reason, seq.stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
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
            seq.prompt_ids,
            seq.num_cached,
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
