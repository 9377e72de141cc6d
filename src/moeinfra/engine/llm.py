"""``LLM``: the offline API in vLLM's shape — ``LLM(model, ranks).generate(prompts, params)``.

``ranks=1`` runs the engine in this process. ``ranks=R > 1`` spawns ``R`` ranks on
``torch.distributed`` that form one unit (:mod:`moeinfra.launcher` starts and watches them):
data-parallel attention (each prompt goes to the rank with the fewest outstanding tokens and lives
there), expert-parallel MoE.
Inside a ``torchrun`` job (the default process group already initialised), every rank creates its
``LLM`` with the same arguments and calls ``generate`` with the same prompts; each rank runs every
``world``-th prompt and every rank returns all results.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moeinfra.engine.config import speculative_tokens
from moeinfra.engine.core import EngineConfig, EngineCore, check_prompt
from moeinfra.engine.hf_config import read_config
from moeinfra.engine.outputs import CompletionOutput, RequestOutput, StepOutput
from moeinfra.engine.registry import architecture
from moeinfra.engine.sampling import SamplingParams
from moeinfra.engine.tiny import default_model
from moeinfra.engine.tokenizer import Tokenizer
from moeinfra.engine.worker import agree, worker_main
from moeinfra.errors import InputError
from moeinfra.moe.comm import Communicator

Prompt = str | list[int] | dict


class LLM:
    """An engine unit serving the checkpoint in ``model`` (default: the built-in tiny one).

    Args:
        model: Hugging Face checkpoint folder (``config.json``, safetensors, tokenizer).
        ranks: ranks of the unit (spawned processes when > 1); None inside ``torchrun``: the job's.
        **engine_options: see :class:`~moeinfra.engine.core.EngineConfig` (``block_size``,
            ``num_kv_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``, ``dtype``,
            ``redundant_experts``, ``eplb_interval``, ``eplb_window``, ``overlap``,
            ``enable_prefix_caching``).
        speculative_config: vLLM's ``{"method": "mtp", "num_speculative_tokens": k}``: ``k``
            drafts per decode step from the checkpoint's MTP layer, verified in the next step.
        comm_delay_s: injected delay per all-to-all payload (to study overlap on one machine).
        timeout_s: a spawned unit that starts or answers slower than this is an error (no hang).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        ranks: int | None = 1,
        *,
        comm_delay_s: float = 0.0,
        timeout_s: float = 300.0,
        speculative_config: dict | None = None,
        **engine_options: Any,
    ) -> None:
        if speculative_config is not None:
            engine_options["num_speculative_tokens"] = speculative_tokens(speculative_config)
        self.model_dir = Path(model) if model is not None else default_model()
        raw = read_config(self.model_dir)  # a bad folder fails here, naming the file
        source = str(self.model_dir / "config.json")
        arch = architecture(raw["model_type"], source)
        self.model_config = arch.parse_config(raw, source)
        engine_options.setdefault("block_size", arch.block_size(self.model_config))
        self.config = EngineConfig(**engine_options)
        self.tokenizer = Tokenizer(self.model_dir)
        self.timeout_s = timeout_s
        self._ids = itertools.count()
        self._ranks = None  # a spawned unit's ranks (moeinfra.launcher.Ranks)
        self._core: EngineCore | None = None
        self._owner: dict[str, int] = {}  # request id -> rank, for a spawned unit
        self._aborted: list[StepOutput] = []
        external = ranks is None and dist.is_available() and dist.is_initialized()
        if ranks is None and not external:
            ranks = 1
        if external:
            self.ranks = dist.get_world_size()
            self._core = EngineCore(
                self.model_dir, self.config, Communicator(delay_s=comm_delay_s), self.tokenizer
            )
        elif not isinstance(ranks, int) or ranks < 1:
            raise InputError(f"ranks={ranks!r} must be a positive integer")
        elif ranks == 1:
            self.ranks = 1
            self._core = EngineCore(self.model_dir, self.config, tokenizer=self.tokenizer)
        else:
            self.ranks = ranks
            self._spawn(ranks, comm_delay_s)

    # ------------------------------------------------------------------ processes
    def _spawn(self, ranks: int, comm_delay_s: float) -> None:
        import torch.multiprocessing as mp

        from moeinfra.launcher import Ranks

        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(ranks)]
        common = (str(self.model_dir), self.config, comm_delay_s)
        timeout = max(30.0, self.timeout_s)
        self._ranks = Ranks(
            worker_main,
            [(*common, inbox, self._outbox, timeout) for inbox in self._inboxes],
            name="engine",
        )
        ready = 0
        while ready < ranks:
            message = self._receive()
            if message[0] == "ready":
                ready += 1

    def _receive(self):
        """The next message of a spawned unit's ranks; raises (and stops them) when one failed
        or nothing came in ``timeout_s``."""
        import queue

        from moeinfra.launcher import RankFailed

        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._outbox.get(timeout=0.5)
            except queue.Empty:
                pass
            try:
                ended = self._ranks.poll() is not None
            except RankFailed:
                self.shutdown()
                raise
            if ended or time.monotonic() > deadline:
                self.shutdown()
                what = "its ranks exited" if ended else f"no answer in {self.timeout_s} s"
                raise RuntimeError(f"engine unit failed: {what}")

    def shutdown(self) -> None:
        """Stop the unit's ranks (idempotent)."""
        if self._ranks is not None:
            for inbox in self._inboxes:
                inbox.put(("shutdown",))
            with contextlib.suppress(RuntimeError, TimeoutError):  # stopped either way
                self._ranks.wait(timeout_s=10)
            self._ranks.close()
            self._ranks = None
            self._inboxes = []
        if self._core is not None:
            self._core.comm.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ generation
    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InputError(
            "prompts must be strings, token-id lists or {'prompt_token_ids': [...]} dicts; "
            f"got {type(prompt).__name__}"
        )

    def _requests(
        self, prompts, sampling_params
    ) -> list[tuple[str, str | None, list[int], SamplingParams]]:
        """``(request id, prompt text, prompt ids, params)`` of each prompt, validated."""
        single = isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        )
        items = [prompts] if single else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise InputError(
                    f"sampling_params has {len(params)} entries for {len(items)} prompts"
                )
        encoded = [self._prompt_ids(p) for p in items]
        for _, ids in encoded:
            check_prompt(self.model_config, ids)
        return [
            (f"req-{next(self._ids)}", text, ids, p)
            for (text, ids), p in zip(encoded, params, strict=True)
        ]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one :class:`RequestOutput` per prompt, in prompt order."""
        requests = self._requests(prompts, sampling_params)
        results = {
            rid: RequestOutput(rid, text, ids, [CompletionOutput(0, "", [])])
            for rid, text, ids, _ in requests
        }
        bar = _progress(len(requests), use_tqdm)
        try:
            for out in self._run(requests):
                _apply(results[out.request_id], out, bar)
        finally:
            bar.close()
        core = self._core
        if core is not None and core.comm.world_size > 1:  # torchrun: every rank gets every result
            gathered: list = [None] * core.comm.world_size
            mine = {
                rid: results[rid] for rid, *_ in requests[core.comm.rank :: core.comm.world_size]
            }
            dist.all_gather_object(gathered, mine, group=core.comm.group)
            for part in gathered:
                results.update(part)
        return [results[rid] for rid, *_ in requests]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[tuple[int, StepOutput]]:
        """Yield ``(prompt index, delta)`` as steps produce tokens: ``delta.new_token_ids``,
        ``delta.new_text``, ``delta.finished``, ``delta.finish_reason``. ``abort(delta.request_id)``
        stops a request (its last delta has ``finish_reason="abort"``)."""
        requests = self._requests(prompts, sampling_params)
        index = {rid: i for i, (rid, *_) in enumerate(requests)}
        for out in self._run(requests):
            yield index[out.request_id], out

    def abort(self, request_id: str) -> None:
        """Stop a request of a running :meth:`stream` and free its KV blocks."""
        if self._ranks is not None:
            rank = self._owner.get(request_id)
            if rank is not None:
                self._inboxes[rank].put(("abort", request_id))
        elif self._core is not None:
            out = self._core.abort(request_id)
            if out is not None:
                self._aborted.append(out)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, rendered with the checkpoint's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt": self.tokenizer.apply_chat_template(c),
                "prompt_token_ids": self.tokenizer.encode_chat(c),
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, requests) -> Iterator[StepOutput]:
        """Submit ``requests``; yield the step outputs of this process's share until they finish.

        Leaving early (a stream the caller stops reading, an exception) aborts what is left, and
        outputs of requests from an earlier, abandoned call are dropped."""
        core = self._core
        mine = requests if core is None else requests[core.comm.rank :: core.comm.world_size]
        pending = {rid for rid, *_ in mine}
        outputs = (
            self._outputs_spawned(mine) if self._ranks is not None else self._outputs_local(mine)
        )
        try:
            for out in outputs:
                if out.request_id not in pending:
                    continue
                if out.finished:
                    pending.discard(out.request_id)
                yield out
                # ranks of a torchrun unit keep stepping with the others until no rank has work
                if not pending and (core is None or core.comm.world_size == 1):
                    return
        finally:
            for rid in pending:
                self.abort(rid)

    def _outputs_local(self, requests) -> Iterator[StepOutput]:
        core = self._core
        for rid, _, ids, params in requests:
            core.add_request(rid, ids, params)
        while True:
            while self._aborted:
                yield self._aborted.pop(0)
            work, prefill, _, _ = agree(core)
            if not work:
                return
            yield from core.step(core.overlap_mode(prefill))

    def _outputs_spawned(self, requests) -> Iterator[StepOutput]:
        outstanding = [0] * self.ranks  # tokens to prefill and decode per rank
        for rid, _, ids, params in requests:
            rank = min(range(self.ranks), key=lambda r: (outstanding[r], r))
            outstanding[rank] += len(ids) + (params.max_tokens or 0)
            self._owner[rid] = rank
            self._inboxes[rank].put(("add", rid, ids, params))
        while True:
            message = self._receive()
            if message[0] != "out":
                continue
            for out in message[2]:
                if out.finished:
                    self._owner.pop(out.request_id, None)
                yield out

    def rebalance(self) -> None:
        """Re-place the unit's experts from recent loads before its next step."""
        if self._ranks is not None:
            for inbox in self._inboxes:
                inbox.put(("rebalance",))
        elif self._core is not None:
            self._core.rebalance()


def _apply(result: RequestOutput, out: StepOutput, bar) -> bool:
    """Fold one step's output into the request's result; True when it just finished."""
    completion = result.outputs[0]
    completion.token_ids.extend(out.new_token_ids)
    completion.text += out.new_text
    if out.logprobs is not None:
        completion.logprobs = (completion.logprobs or []) + out.logprobs
    if out.prompt_logprobs is not None:
        result.prompt_logprobs = [None, *out.prompt_logprobs]
    result.num_cached_tokens = out.num_cached_tokens
    result.num_draft_tokens = out.num_draft_tokens
    result.num_accepted_tokens = out.num_accepted_tokens
    if out.finished and not result.finished:
        result.finished = True
        result.outputs[0] = replace(
            completion, finish_reason=out.finish_reason, stop_reason=out.stop_reason
        )
        bar.update(1)
        return True
    return False


def _progress(total: int, enabled: bool):
    import sys

    from tqdm import tqdm

    return tqdm(
        total=total,
        desc="generate",
        unit="req",
        disable=not enabled or not sys.stderr.isatty() or total < 2,
    )
