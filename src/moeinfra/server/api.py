"""The OpenAI-compatible HTTP API (FastAPI on uvicorn) in front of the router.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` as server-sent events,
``stream_options.include_usage``, ``n`` choices, ``usage.prompt_tokens_details.cached_tokens``),
``GET /v1/models``, vLLM's ``POST /tokenize`` and ``POST /detokenize``, ``GET /health``,
``GET /metrics``. Errors have OpenAI's body
(``{"error": {"message", "type", "param", "code"}}``): 400 for a bad request, 404 for an unknown
model, 503 with ``Retry-After`` when the system is full. A client that disconnects aborts its
requests on every unit.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from moeinfra.engine.sampling import SamplingParams
from moeinfra.errors import InputError
from moeinfra.server.router import NoUnits, Overloaded, Router, Tracked


class APIError(Exception):
    """An HTTP error with OpenAI's body; ``retry_after_s`` adds a ``Retry-After`` header."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s


def _error_body(status: int, message: str, param=None, code=None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]


class ChatRequest(_Sampling):
    messages: list[dict]
    max_completion_tokens: int | None = None


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a ``prompt`` (with ``add_special_tokens``, default True) or chat
    ``messages`` (rendered by the chat template; ``add_special_tokens`` default False)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids -> their text (special tokens kept)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


@dataclass
class ServerLimits:
    """``max_model_len``: prompt + output tokens per request; ``max_n``: choices per request."""

    max_model_len: int
    max_n: int = 8
    default_completion_tokens: int = 16  # OpenAI's default for /v1/completions


@dataclass
class _Choice:
    index: int
    tracked: Tracked
    text: str = ""
    tokens: int = 0
    cached: int | None = None
    finish_reason: str | None = None
    first_s: float | None = None
    last_s: float | None = None


def create_app(
    router: Router,
    tokenizer,
    model_name: str,
    limits: ServerLimits,
    *,
    cache_probe=None,
    metrics=None,
    lifespan=None,
    model_config: dict | None = None,
) -> FastAPI:
    """The ASGI app. ``cache_probe(prompt_ids) -> tokens`` estimates the on-disk prefix hit (for
    the prefill balancer); ``metrics`` a :class:`~moeinfra.server.metrics.ServerMetrics`;
    ``model_config`` the checkpoint's ``config.json`` (served with the step log)."""
    app = FastAPI(title="moeinfra", lifespan=lifespan)
    numbers = itertools.count()
    prefix = uuid.uuid4().hex[:8]
    created_at = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError):
        headers = None if err.retry_after_s is None else {"Retry-After": str(err.retry_after_s)}
        return JSONResponse(
            _error_body(err.status, err.message, err.param, err.code), err.status, headers=headers
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        else:
            message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(_error_body(400, message, ".".join(where) or None), 400)

    @app.get("/health")
    async def health():
        ok = router.live_units(("prefill", "colocated")) and router.live_units(
            ("decode", "colocated")
        )
        status = 200 if ok and router.accepting else 503
        units = {
            u.unit_id: {
                "role": u.role,
                "ready": u.ready,
                "draining": u.draining,
                "host": u.host,
                "pids": [r.pid for r in u.ranks],
                "device": u.ranks[0].info.get("device") if u.ranks else None,
                "dtype": u.ranks[0].info.get("dtype") if u.ranks else None,
                "speculative_tokens": u.ranks[0].info.get("num_speculative_tokens", 0)
                if u.ranks
                else None,
            }
            for u in router.units.values()
            if u.alive
        }
        body = {
            "status": "ok" if status == 200 else "unavailable",
            "units": units,
            "events": list(router.notes)[-20:],  # units lost or drained, autoscaling decisions
        }
        return JSONResponse(body, status)

    @app.get("/metrics")
    async def prometheus():
        body = metrics.render(router) if metrics is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/calibration/steps")
    async def steps():
        """Recent engine steps of every live unit (what ``moeinfra serve calibrate`` fits)."""
        units = []
        for u in router.live_units(("prefill", "decode", "colocated")):
            info = u.ranks[0].info if u.ranks else {}
            engine = {
                k: info.get(k)
                for k in (
                    "block_size",
                    "num_kv_blocks",
                    "max_num_seqs",
                    "max_num_batched_tokens",
                    "redundant_experts",
                    "dtype",
                )
            }
            units.append(
                {
                    "unit": u.unit_id,
                    "role": u.role,
                    "ranks": u.num_ranks,
                    "host": u.host,
                    "engine": engine,
                    "steps": u.step_records(),
                }
            )
        return {
            "model": model_name,
            "config": model_config or {},
            "capacity": router.capacity(),
            "units": units,
        }

    def _check_optional_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_optional_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            if body.continue_final_message:
                raise APIError(
                    400, "continue_final_message=True is not supported", "continue_final_message"
                )
            try:
                text = tokenizer.apply_chat_template(body.messages, body.add_generation_prompt)
            except Exception as err:  # a template that cannot render these messages
                raise APIError(400, f"messages could not be rendered: {err}", "messages") from None
            ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tokenizer.encode(body.prompt, add_special_tokens=special)
        return {
            "count": len(ids),
            "max_model_len": limits.max_model_len,
            "tokens": ids,
            "token_strs": [tokenizer.id_to_token(t) for t in ids]
            if body.return_token_strs
            else None,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_optional_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(
                400, f"token id {bad[0]} is outside 0..{tokenizer.vocab_size - 1}", "tokens"
            )
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created_at,
                    "owned_by": "moeinfra",
                    "max_model_len": limits.max_model_len,
                }
            ],
        }

    def _check_model(body: _Sampling) -> None:
        if body.model != model_name:
            raise APIError(
                404, f"The model `{body.model}` does not exist.", "model", "model_not_found"
            )

    def _params(body: _Sampling, prompt_len: int, max_tokens: int | None, seed_offset: int):
        if body.n < 1 or body.n > limits.max_n:
            raise APIError(400, f"n={body.n} must be in 1..{limits.max_n}", "n")
        for name in ("logprobs", "presence_penalty", "frequency_penalty"):
            value = getattr(body, name)
            if value not in (None, 0, False):
                raise APIError(400, f"{name}={value!r} is not supported", name)
        room = limits.max_model_len - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {limits.max_model_len} tokens; "
                f"the prompt has {prompt_len}",
                "messages" if isinstance(body, ChatRequest) else "prompt",
                "context_length_exceeded",
            )
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {limits.max_model_len} tokens; you "
                f"requested {prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} "
                "to generate)",
                "max_tokens",
                "context_length_exceeded",
            )
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                max_tokens=room if max_tokens is None else max_tokens,
                stop=body.stop,
                seed=None if body.seed is None else body.seed + seed_offset,
                min_tokens=body.min_tokens,
                ignore_eos=body.ignore_eos,
            )
        except InputError as err:
            raise APIError(400, str(err), str(err).split("=", 1)[0]) from None

    def _encode_prompts(body: CompletionRequest) -> list[list[int]]:
        p = body.prompt
        items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not items:
            raise APIError(400, "prompt must not be empty", "prompt")
        out = []
        for item in items:
            ids = tokenizer.encode(item) if isinstance(item, str) else list(item)
            if not ids:
                raise APIError(400, "prompt must have at least one token", "prompt")
            if min(ids) < 0 or max(ids) >= tokenizer.vocab_size:
                raise APIError(
                    400, f"prompt token ids must be in 0..{tokenizer.vocab_size - 1}", "prompt"
                )
            out.append(ids)
        return out

    def _start(prompts: list[list[int]], body: _Sampling, max_tokens: int | None) -> list[_Choice]:
        choices = []
        events: asyncio.Queue = asyncio.Queue()
        try:
            for p, ids in enumerate(prompts):
                for k in range(body.n):
                    params = _params(body, len(ids), max_tokens, k)
                    tracked = Tracked(
                        f"{prefix}-{next(numbers)}",
                        ids,
                        params,
                        cache_probe(ids) if cache_probe is not None else 0,
                        events=events,
                    )
                    router.submit(tracked)
                    choices.append(_Choice(p * body.n + k, tracked))
        except (Overloaded, NoUnits) as err:
            for c in choices:
                router.abort(c.tracked.request_id)
            raise APIError(
                503, str(err), None, "overloaded", getattr(err, "retry_after_s", 1)
            ) from None
        except APIError:
            for c in choices:
                router.abort(c.tracked.request_id)
            raise
        return choices

    async def _events(choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, str, int]]:
        """``(choice, new text, new tokens)`` as tokens arrive, until every choice finished."""
        by_id = {c.tracked.request_id: c for c in choices}
        events = choices[0].tracked.events
        left = len(choices)
        while left:
            event = await events.get()
            if isinstance(event, tuple):
                kind, rid = event[0], event[1]
                choice = by_id[rid]
                if kind == "restart":
                    choice.text, choice.tokens, choice.cached, choice.first_s = "", 0, None, None
                    continue
                raise APIError(500, f"request failed: {event[2]}", None, "unit_failed")
            choice = by_id[event.request_id]
            now = time.monotonic()
            if event.new_token_ids:
                if choice.first_s is None:
                    choice.first_s = now
                    choice.cached = event.num_cached_tokens
                    if metrics is not None:
                        metrics.ttft.observe(now - choice.tracked.arrival_s)
                elif metrics is not None:
                    metrics.itl.observe(now - choice.last_s)
                choice.last_s = now
                choice.tokens += len(event.new_token_ids)
            choice.text += event.new_text
            if event.finished:
                choice.finish_reason = "length" if event.finish_reason == "length" else "stop"
                left -= 1
                _record(choice)
            yield choice, event.new_text, len(event.new_token_ids)

    def _record(choice: _Choice) -> None:
        if metrics is None:
            return
        metrics.finished(choice.finish_reason)
        metrics.prompt_tokens.inc(len(choice.tracked.prompt_ids))
        metrics.generation_tokens.inc(choice.tokens)
        metrics.cache_hit_tokens.inc(choice.cached or 0)
        if choice.tokens > 1:
            metrics.tpot.observe((choice.last_s - choice.first_s) / (choice.tokens - 1))

    def _usage(prompts: list[list[int]], choices: list[_Choice], n: int) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(c.tokens for c in choices)
        cached = sum(c.cached or 0 for c in choices if c.index % n == 0)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _watch_disconnect(request: Request, choices: list[_Choice]) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)
        for c in choices:
            router.abort(c.tracked.request_id)

    async def _complete(request: Request, choices: list[_Choice]) -> None:
        watcher = asyncio.create_task(_watch_disconnect(request, choices))
        try:
            async for _ in _events(choices):
                pass
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            for c in choices:
                if c.finish_reason is None:
                    router.abort(c.tracked.request_id)

    def _sse(payload: dict) -> bytes:
        return b"data: " + msgspec.json.encode(payload) + b"\n\n"

    async def _stream(
        choices: list[_Choice], chunk, final, usage, include_usage: bool
    ) -> AsyncIterator[bytes]:
        try:
            for c in choices:
                first = chunk(c, None)
                if first is not None:
                    yield _sse(first)
            async for choice, text, tokens in _events(choices):
                choice.tracked.streamed = True
                # a chunk for every token, even one whose text is not complete yet (vLLM does the
                # same): the client's time to first token is the first token's
                if text or tokens:
                    yield _sse(chunk(choice, text))
                if choice.finish_reason is not None:
                    yield _sse(final(choice))
            if include_usage:
                yield _sse(usage())
            yield b"data: [DONE]\n\n"
        except APIError as err:
            yield _sse(_error_body(err.status, err.message, err.param, err.code))
        finally:  # the client went away (or the server stops): abort what is left everywhere
            for c in choices:
                if c.finish_reason is None:
                    router.abort(c.tracked.request_id)

    async def _respond(body: _Sampling, request: Request, choices, stream_parts, whole):
        """A streamed response (``stream_parts`` = chunk, final and usage builders) or, once every
        choice finished, ``whole()``."""
        if body.stream:
            include = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(
                _stream(choices, *stream_parts, include), media_type="text/event-stream"
            )
        await _complete(request, choices)
        return whole()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body)
        prompts = _encode_prompts(body)
        max_tokens = (
            body.max_tokens
            if "max_tokens" in body.model_fields_set
            else limits.default_completion_tokens
        )
        choices = _start(prompts, body, max_tokens)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}

        def chunk(c: _Choice, text: str | None):
            if text is None:
                return None
            return head | {
                "choices": [
                    {"index": c.index, "text": text, "logprobs": None, "finish_reason": None}
                ],
            }

        def final(c: _Choice):
            out = chunk(c, "")
            out["choices"][0]["finish_reason"] = c.finish_reason
            return out

        def usage():
            return head | {"choices": [], "usage": _usage(prompts, choices, body.n)}

        def whole():
            return head | {
                "choices": [
                    {
                        "index": c.index,
                        "text": c.text,
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                    }
                    for c in choices
                ],
                "usage": _usage(prompts, choices, body.n),
            }

        return await _respond(body, request, choices, (chunk, final, usage), whole)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(body)
        try:
            ids = tokenizer.encode_chat(body.messages)
        except Exception as err:  # a template that cannot render these messages
            raise APIError(400, f"messages could not be rendered: {err}", "messages") from None
        prompts = [ids]
        max_tokens = body.max_completion_tokens or body.max_tokens
        choices = _start(prompts, body, max_tokens)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        head = {"id": rid, "object": "chat.completion", "created": created, "model": model_name}
        streamed = head | {"object": "chat.completion.chunk"}

        def chunk(c: _Choice, text: str | None):
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
            return streamed | {
                "choices": [
                    {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}
                ],
            }

        def final(c: _Choice):
            return streamed | {
                "choices": [
                    {
                        "index": c.index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                    }
                ],
            }

        def usage():
            return streamed | {"choices": [], "usage": _usage(prompts, choices, body.n)}

        def whole():
            return head | {
                "choices": [
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                    }
                    for c in choices
                ],
                "usage": _usage(prompts, choices, body.n),
            }

        return await _respond(body, request, choices, (chunk, final, usage), whole)

    return app
