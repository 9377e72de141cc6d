"""The OpenAI-compatible HTTP API (FastAPI on uvicorn) in front of the router.

``POST /v1/completions`` and ``POST /v1/chat/completions`` take every field vLLM's server takes
(:mod:`~moeinfra.server.protocol`: honoured with vLLM's meaning, or refused with a 400 naming it):
``stream`` as server-sent events with ``stream_options`` (``include_usage``,
``continuous_usage_stats``), ``n`` choices, ``logprobs`` / ``top_logprobs`` /
``prompt_logprobs`` (:mod:`~moeinfra.server.logprobs_format`), ``echo`` (with ``max_tokens`` 0
on completions: score the prompt), penalties, ``logit_bias``, ``stop_token_ids``, chat
``content`` as text parts, ``chat_template_kwargs``, ``continue_final_message``; choices carry
``stop_reason``; usage carries ``prompt_tokens_details.cached_tokens``. Also ``GET /v1/models``,
vLLM's ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` and ``GET /version``,
``GET /health``, ``GET /metrics``. Errors have OpenAI's body (``{"error": {"message", "type",
"param", "code"}}``): 400 for a bad request, 404 for an unknown model, 503 with ``Retry-After``
when the system is full. Tokenising and rendering chat templates run off the event loop. A
client that disconnects aborts its requests on every unit.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeinfra.engine.outputs import Logprobs
from moeinfra.server.chat_output import ChatOptions, ChatOutput, forced_schema, resolve_tool_choice
from moeinfra.server.logprobs_format import (
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from moeinfra.server.metrics import RequestTimes
from moeinfra.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    check_refused,
    check_token_ids,
    logprobs_of,
    message_text,
    prompt_logprobs_of,
    requested_n,
    sampling_params,
    truncated,
)
from moeinfra.server.reasoning import REASONING_PARSERS, THINK_END
from moeinfra.server.router import NoUnits, Overloaded, Router, Tracked
from moeinfra.server.structured_output import grammar_of, json_grammar

__all__ = ["APIError", "ServerLimits", "create_app"]


def _error_body(status: int, message: str, param=None, code=None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a ``prompt`` (with ``add_special_tokens``, default True) or chat
    ``messages`` (rendered by the chat template; ``add_special_tokens`` default False)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None
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
    """One choice as it arrives: its text, tokens and their log-probabilities so far."""

    index: int
    tracked: Tracked
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs] | None = None
    cached: int | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_s: float | None = None
    last_s: float | None = None
    queued_s: float = 0.0  # seconds it waited on its prefill rank before its first step
    offset: int = 0  # characters of token text streamed so far (logprobs' text_offset)
    opened: bool = False  # a streamed choice's first content chunk went out


@dataclass(frozen=True)
class _Chunks:
    """How a streamed response is written: ``open(choice)`` (chunks before any token),
    ``delta(choice, step output)`` (a chunk or None), ``final(choice)``; ``head`` starts each."""

    head: dict
    open: Callable
    delta: Callable
    final: Callable


@dataclass
class _Call:
    """What one API call decided before its choices run."""

    prompts: list[list[int]]
    prompt_texts: list[str | None]
    n: int
    logprobs: int | None
    prompt_logprobs: int | None
    echo_only: bool  # completions with echo and max_tokens 0: the prompt is the answer
    names: TokenNames
    grammar: str | None = None  # llguidance grammar the output follows (structured output)
    grammar_after: str | None = None  # ... once the output holds this (the end of thinking)
    choices: list[_Choice] = field(default_factory=list)

    def usage(self) -> dict:
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion = 0 if self.echo_only else sum(len(c.token_ids) for c in self.choices)
        cached = sum(c.cached or 0 for c in self.choices if c.index % self.n == 0)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets a 413 (by its Content-Length
    before anything is read, or as soon as a chunked body passes the limit)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    def _too_large(self) -> str:
        return f"the request body is over {self.limit} bytes (--max-request-bytes)"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await JSONResponse(_error_body(413, self._too_large()), 413)(scope, receive, send)
            return
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise StarletteHTTPException(413, self._too_large())
            return message

        await self.app(scope, limited, send)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moeinfra")
    except PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"


def _json_safe(value):
    """``tokenizer_config.json`` values as JSON (added tokens as their text)."""
    if isinstance(value, dict):
        if set(value) >= {"content"} and "__type" in value:
            return value["content"]
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


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
    model_root: str | None = None,
    tokenizer_config: dict | None = None,
    max_request_bytes: int = 32 << 20,
    chat_options: ChatOptions | None = None,
) -> FastAPI:
    """The ASGI app. ``cache_probe(prompt_ids) -> tokens`` estimates the on-disk prefix hit (for
    the prefill balancer); ``metrics`` a :class:`~moeinfra.server.metrics.ServerMetrics`;
    ``model_config`` the checkpoint's ``config.json`` (served with the step log), ``model_root``
    its folder (``root`` in ``/v1/models``), ``tokenizer_config`` its ``tokenizer_config.json``
    (served by ``/tokenizer_info``)."""
    vocab_size = (model_config or {}).get("vocab_size", tokenizer.vocab_size)
    chat_options = chat_options or ChatOptions()
    app = FastAPI(title="moeinfra", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    numbers = itertools.count()
    prefix = uuid.uuid4().hex[:8]
    created_at = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError):
        headers = None if err.retry_after_s is None else {"Retry-After": str(err.retry_after_s)}
        return JSONResponse(
            _error_body(err.status, err.message, err.param, err.code), err.status, headers=headers
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException):
        return JSONResponse(_error_body(err.status_code, str(err.detail)), err.status_code)

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
                "kv_addresses": [r.kv_address for r in u.ranks if r.kv_address],
                "device": u.ranks[0].info.device if u.ranks else None,
                "dtype": u.ranks[0].info.dtype if u.ranks else None,
                "speculative_tokens": u.ranks[0].info.num_speculative_tokens if u.ranks else None,
                "kv_connector": u.ranks[0].info.kv_connector if u.ranks else None,
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

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/calibration/steps")
    async def steps():
        """Recent engine steps of every live unit (what ``moeinfra serve calibrate`` fits)."""
        units = []
        for u in router.live_units(("prefill", "decode", "colocated")):
            info = u.ranks[0].info if u.ranks else None
            engine = {
                k: getattr(info, k, None)
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

    def _check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    # ------------------------------------------------------------------ tokenizer endpoints
    def _render(
        messages: list[dict],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict | None,
        documents: list | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The conversation's prompt text (vLLM's rules: text parts joined, the final message
        continued rather than closed with ``continue_final_message``)."""
        kwargs = dict(template_kwargs or {})
        for reserved in ("chat_template", "tokenize"):
            if reserved in kwargs:
                raise APIError(
                    400, f"chat_template_kwargs: {reserved!r} cannot be set", "chat_template_kwargs"
                )
        if documents is not None:
            kwargs["documents"] = documents
        if tools is not None:
            kwargs["tools"] = tools
        plain = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise APIError(400, "every message needs a role", "messages")
            plain.append(m | {"content": message_text(m.get("content"))})
        if continue_final_message and (not plain or plain[-1]["role"] != "assistant"):
            raise APIError(
                400,
                "continue_final_message needs a final assistant message to continue",
                "continue_final_message",
            )
        try:
            text = tokenizer.apply_chat_template(plain, add_generation_prompt, **kwargs)
        except Exception as err:  # a template that cannot render these messages
            raise APIError(400, f"messages could not be rendered: {err}", "messages") from None
        if continue_final_message:
            final = plain[-1]["content"]
            at = text.rfind(final.strip())
            if at < 0 or not final.strip():
                raise APIError(
                    400,
                    "continue_final_message is set but the final message does not appear in "
                    "the rendered chat",
                    "continue_final_message",
                )
            whole = final.lstrip()
            text = text[: at + (len(whole) if text.startswith(whole, at) else len(final.strip()))]
        return text

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")

        def work() -> list[int]:
            if body.messages is not None:
                add = body.add_generation_prompt and not body.continue_final_message
                text = _render(
                    body.messages, add, body.continue_final_message, body.chat_template_kwargs,
                    tools=body.tools,
                )  # fmt: skip
                return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
            special = True if body.add_special_tokens is None else body.add_special_tokens
            return tokenizer.encode(body.prompt, add_special_tokens=special)

        ids = await asyncio.to_thread(work)
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
        _check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(
                400, f"token id {bad[0]} is outside 0..{tokenizer.vocab_size - 1}", "tokens"
            )
        text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """The tokenizer's configuration (``tokenizer_config.json`` without file names), as vLLM's
        ``--enable-tokenizer-info-endpoint`` serves it (lm-evaluation-harness's remote
        tokenizer reads it)."""
        info = {
            k: _json_safe(v)
            for k, v in (tokenizer_config or {}).items()
            if k not in ("vocab_file", "merges_file")
        }
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        info.setdefault("model_max_length", limits.max_model_len)
        return info

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
                    "root": model_root or model_name,
                    "parent": None,
                    "max_model_len": limits.max_model_len,
                }
            ],
        }

    # ------------------------------------------------------------------ generation
    def _room(prompt_len: int, max_tokens: int | None, chat: bool) -> int:
        """The request's output tokens: ``max_tokens``, or what the context leaves."""
        room = limits.max_model_len - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {limits.max_model_len} tokens; "
                f"the prompt has {prompt_len}",
                "messages" if chat else "prompt",
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
        return room if max_tokens is None else max_tokens

    async def _start(call: _Call, body, max_tokens: int | None) -> None:
        """Submit every choice of every prompt; on any refusal abort those already placed."""
        events: asyncio.Queue = asyncio.Queue()
        chat = isinstance(body, ChatRequest)
        on_disk = [0] * len(call.prompts)
        if cache_probe is not None and call.prompt_logprobs is None:
            # file probes on a shared file system can take milliseconds: not on the event loop
            on_disk = await asyncio.to_thread(lambda: [cache_probe(ids) for ids in call.prompts])
        try:
            for p, ids in enumerate(call.prompts):
                tokens = _room(len(ids), max_tokens, chat)
                for k in range(call.n):
                    params = sampling_params(
                        body, tokens, k, call.prompt_logprobs, call.grammar, call.grammar_after
                    )
                    check_token_ids(params, vocab_size)
                    tracked = Tracked(
                        f"{prefix}-{next(numbers)}",
                        ids,
                        params,
                        on_disk[p],
                        events=events,
                    )
                    router.submit(tracked)
                    call.choices.append(_Choice(p * call.n + k, tracked, ids))
        except (Overloaded, NoUnits) as err:
            for c in call.choices:
                router.abort(c.tracked.request_id)
            raise APIError(
                503, str(err), None, "overloaded", getattr(err, "retry_after_s", 1)
            ) from None
        except APIError:
            for c in call.choices:
                router.abort(c.tracked.request_id)
            raise

    async def _events(call: _Call) -> AsyncIterator[tuple[_Choice, object]]:
        """``(choice, step output)`` as outputs arrive, until every choice finished."""
        by_id = {c.tracked.request_id: c for c in call.choices}
        events = call.choices[0].tracked.events
        left = len(call.choices)
        while left:
            event = await events.get()
            if isinstance(event, tuple):
                kind, rid = event[0], event[1]
                choice = by_id[rid]
                if kind == "restart":
                    choice.text, choice.cached, choice.first_s = "", None, None
                    choice.token_ids, choice.logprobs, choice.prompt_logprobs = [], [], None
                    continue
                raise APIError(500, f"request failed: {event[2]}", None, "unit_failed")
            choice = by_id[event.request_id]
            now = time.monotonic()
            if event.new_token_ids:
                if choice.first_s is None:
                    choice.first_s = now
                    choice.cached = event.num_cached_tokens
                    choice.queued_s = event.queued_s
                    if metrics is not None:
                        metrics.first_token(now - choice.tracked.arrival_s)
                elif metrics is not None:
                    metrics.token_gap(now - choice.last_s)
                choice.last_s = now
                choice.token_ids += event.new_token_ids
            if event.logprobs:
                choice.logprobs += event.logprobs
            if event.prompt_logprobs is not None:
                choice.prompt_logprobs = event.prompt_logprobs
            choice.text += event.new_text
            if event.finished:
                choice.finish_reason = "length" if event.finish_reason == "length" else "stop"
                choice.stop_reason = event.stop_reason
                left -= 1
                _record(choice)
            yield choice, event

    def _record(choice: _Choice) -> None:
        if metrics is None:
            return
        arrival = choice.tracked.arrival_s
        first = choice.first_s
        metrics.request_finished(
            RequestTimes(
                finish_reason=choice.finish_reason,
                prompt_tokens=len(choice.prompt_ids),
                generated=len(choice.token_ids),
                cached=choice.cached or 0,
                max_tokens=choice.tracked.params.max_tokens or 0,
                e2e_s=time.monotonic() - arrival,
                ttft_s=None if first is None else first - arrival,
                queue_s=choice.queued_s,
                decode_s=0.0 if first is None else choice.last_s - first,
            )
        )

    async def _disconnected(request: Request) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)

    async def _drain(call: _Call) -> None:
        async for _ in _events(call):
            pass

    async def _complete(request: Request, call: _Call) -> bool:
        """Wait until every choice finished (True) or the client went away (False: its requests
        are aborted everywhere and the handler is free at once)."""
        outputs = asyncio.ensure_future(_drain(call))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait((outputs, watcher), return_when=asyncio.FIRST_COMPLETED)
            if outputs in done:
                outputs.result()  # an APIError of a failed request goes to its handler
                return True
            return False
        finally:
            for task in (outputs, watcher):
                task.cancel()
            await asyncio.gather(outputs, watcher, return_exceptions=True)
            for c in call.choices:
                if c.finish_reason is None:
                    router.abort(c.tracked.request_id)

    def _sse(payload: dict) -> bytes:
        return b"data: " + msgspec.json.encode(payload) + b"\n\n"

    async def _stream(call: _Call, chunks: _Chunks, include_usage: bool, every_usage: bool):
        try:
            for c in call.choices:
                for payload in chunks.open(c):
                    yield _sse(_with_usage(payload, call, every_usage))
            async for choice, event in _events(call):
                choice.tracked.streamed = True
                # a chunk for every token, even one whose text is not complete yet (vLLM does the
                # same): the client's time to first token is the first token's
                if event.new_text or event.new_token_ids or event.finished:
                    payload = chunks.delta(choice, event)
                    if payload is not None:
                        yield _sse(_with_usage(payload, call, every_usage))
                if choice.finish_reason is not None:
                    yield _sse(_with_usage(chunks.final(choice), call, every_usage))
            if include_usage:
                yield _sse(chunks.head | {"choices": [], "usage": call.usage()})
            yield b"data: [DONE]\n\n"
        except APIError as err:
            yield _sse(_error_body(err.status, err.message, err.param, err.code))
        finally:  # the client went away (or the server stops): abort what is left everywhere
            for c in call.choices:
                if c.finish_reason is None:
                    router.abort(c.tracked.request_id)

    def _with_usage(payload: dict, call: _Call, every: bool) -> dict:
        return payload | {"usage": call.usage()} if every else payload

    async def _respond(body, request: Request, call: _Call, chunks: _Chunks, whole):
        """A streamed response or, once every choice finished, ``whole()``."""
        if body.stream:
            final_usage, every_usage = body.stream_usage()
            return StreamingResponse(
                _stream(call, chunks, final_usage, every_usage), media_type="text/event-stream"
            )
        if not await _complete(request, call):
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        return whole()

    def _prepare(body, prompts, prompt_texts) -> _Call:
        check_refused(body)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options can only be set when stream=true", "stream_options")
        return _Call(
            prompts,
            prompt_texts,
            requested_n(body, limits.max_n),
            logprobs_of(body),
            prompt_logprobs_of(body),
            False,
            TokenNames(tokenizer, bool(body.return_tokens_as_token_ids)),
        )

    def _prompt_logprobs_field(body, choice: _Choice) -> list | None:
        """``prompt_logprobs`` of a response: only when the request named the field (as vLLM;
        ``echo`` alone puts them in ``logprobs``)."""
        if body.prompt_logprobs is None or choice.prompt_logprobs is None:
            return None
        return prompt_logprobs(choice.prompt_logprobs, tokenizer)

    def _head(body, prefix: str, kind: str) -> dict:
        """The fields every response and chunk opens with (the id from ``request_id``)."""
        return {
            "id": f"{prefix}-{body.request_id or uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": model_name,
        }

    # ------------------------------------------------------------------ /v1/completions
    def _encode_prompts(body: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
        p = body.prompt
        if p is None or p == "" or p == []:
            raise APIError(400, "prompt must not be empty", "prompt")
        items = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids_out, texts = [], []
        for item in items:
            ids = (
                tokenizer.encode(item, add_special_tokens=special)
                if isinstance(item, str)
                else list(item)
            )
            if not ids:
                raise APIError(400, "prompt must have at least one token", "prompt")
            if min(ids) < 0 or max(ids) >= tokenizer.vocab_size:
                raise APIError(
                    400, f"prompt token ids must be in 0..{tokenizer.vocab_size - 1}", "prompt"
                )
            whole = len(ids)
            ids = truncated(body, ids, limits.max_model_len)
            ids_out.append(ids)
            # echo shows the prompt as given (or decoded from its ids, and when truncated)
            texts.append(item if isinstance(item, str) and len(ids) == whole else None)
        return ids_out, texts

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model)
        prompts, texts = await asyncio.to_thread(_encode_prompts, body)
        call = _prepare(body, prompts, texts)
        call.grammar = await asyncio.to_thread(grammar_of, body)
        max_tokens = (
            body.max_tokens
            if "max_tokens" in body.model_fields_set
            else limits.default_completion_tokens
        )
        if max_tokens == 0 and body.echo:
            call.echo_only, max_tokens = True, 1  # the engine samples one token, not shown
        elif max_tokens is not None and max_tokens < 1:
            raise APIError(
                400, f"max_tokens={max_tokens} must be >= 1 (0 only with echo)", "max_tokens"
            )
        await _start(call, body, max_tokens)
        head = _head(body, "cmpl", "text_completion")
        wants_logprobs = call.logprobs is not None

        def prompt_text(c: _Choice) -> str:
            text = call.prompt_texts[c.index // call.n]
            return text if text is not None else tokenizer.decode(c.prompt_ids, False)

        def echoed(c: _Choice) -> tuple[list[int], list]:
            """The echoed prompt's tokens and log-probability entries."""
            entries = [None] * len(c.prompt_ids)
            if c.prompt_logprobs is not None:
                entries = [None, *c.prompt_logprobs]
            return c.prompt_ids, entries

        def choice_body(c: _Choice, text: str, ids: list[int], entries: list, finished: bool):
            lp = completion_logprobs(ids, entries, call.names, c.offset) if wants_logprobs else None
            if lp and ids:  # where the next chunk's tokens start
                c.offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
            return {
                "index": c.index,
                "text": text,
                "logprobs": lp,
                "finish_reason": c.finish_reason if finished else None,
                "stop_reason": c.stop_reason if finished else None,
            }

        def open_(c: _Choice) -> list:
            return []

        def delta(c: _Choice, event):
            text, ids = event.new_text, list(event.new_token_ids)
            entries = list(event.logprobs or [None] * len(ids))
            if call.echo_only:
                ids, entries, text = [], [], ""
            if body.echo and not c.opened:
                prompt_ids, prompt_entries = echoed(c)
                text, ids = prompt_text(c) + text, prompt_ids + ids
                entries = prompt_entries + entries
            c.opened = True
            if not text and not ids and call.echo_only:
                return None
            return head | {"choices": [choice_body(c, text, ids, entries, False)]}

        def final(c: _Choice):
            return head | {"choices": [choice_body(c, "", [], [], True)]}

        def whole():
            choices = []
            for c in call.choices:
                ids, entries, text = [], [], ""
                if body.echo:
                    ids, entries = echoed(c)
                    text = prompt_text(c)
                if not call.echo_only:
                    ids, entries = (
                        ids + c.token_ids,
                        entries + (c.logprobs or [None] * len(c.token_ids)),
                    )
                    text += c.text
                choice = choice_body(c, text, ids, entries, True)
                choice["prompt_logprobs"] = _prompt_logprobs_field(body, c)
                if body.return_token_ids:
                    choice["prompt_token_ids"] = c.prompt_ids
                    choice["token_ids"] = [] if call.echo_only else c.token_ids
                choices.append(choice)
            return head | {"choices": choices, "usage": call.usage()}

        return await _respond(body, request, call, _Chunks(head, open_, delta, final), whole)

    # ------------------------------------------------------------------ /v1/chat/completions
    def _chat_prompt(body: ChatRequest) -> tuple[list[int], str | None, str]:
        """The prompt's ids, the text ``echo`` shows (or None), and the answer's role."""
        if (
            body.continue_final_message
            and body.add_generation_prompt
            and ("add_generation_prompt" in body.model_fields_set)
        ):
            raise APIError(
                400,
                "Cannot set both continue_final_message and add_generation_prompt to true",
                "continue_final_message",
            )
        add = body.add_generation_prompt and not body.continue_final_message
        text = _render(
            body.messages, add, body.continue_final_message, body.chat_template_kwargs,
            body.documents, body.tools,
        )  # fmt: skip
        ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        ids = truncated(body, ids, limits.max_model_len)
        last = body.messages[-1] if body.messages else {}
        role = "assistant" if add else last.get("role", "assistant")
        echo = message_text(last.get("content")) if body.echo and last.get("role") == role else None
        return ids, echo, role

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(body.model)
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        mode, function = resolve_tool_choice(body.tools, body.tool_choice, chat_options)
        parallel = body.parallel_tool_calls is not False
        ids, echo, role = await asyncio.to_thread(_chat_prompt, body)
        call = _prepare(body, [ids], [None])
        schema = forced_schema(body.tools or [], mode, function, parallel)
        # a forced tool call's schema replaces any response format (as in vLLM)
        if schema is None:
            call.grammar = await asyncio.to_thread(grammar_of, body)
        else:
            call.grammar = await asyncio.to_thread(json_grammar, schema, "tool_choice")
        if chat_options.reasoning_parser:
            parser = REASONING_PARSERS[chat_options.reasoning_parser](body.chat_template_kwargs)
            # a reasoning model thinks freely first; its answer follows the grammar (as vLLM)
            call.grammar_after = THINK_END if parser.thinks() else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        await _start(call, body, max_tokens)
        head = _head(body, "chatcmpl", "chat.completion")
        streamed = head | {"object": "chat.completion.chunk"}
        wants_logprobs = call.logprobs is not None

        def logprobs_body(ids: list[int], entries: list) -> dict | None:
            if not wants_logprobs:
                return None
            return chat_logprobs(ids, entries, call.names, tokenizer)

        template_kwargs = body.chat_template_kwargs
        readers = {
            c.index: ChatOutput(chat_options, body.tools, mode, function, template_kwargs, parallel)
            for c in call.choices
        }

        def shown(message: dict) -> dict:
            if not body.include_reasoning:
                message.pop("reasoning", None)
                message.pop("reasoning_content", None)
            return message

        def open_(c: _Choice) -> list:
            out = [streamed | {"choices": [_chunk_choice(c, {"role": role, "content": ""})]}]
            if echo:
                out.append(streamed | {"choices": [_chunk_choice(c, {"content": echo})]})
            return out

        def delta(c: _Choice, event):
            lp = logprobs_body(list(event.new_token_ids), list(event.logprobs or []))
            update = shown(readers[c.index].delta(event.new_text, final=event.finished))
            if not update and lp is None and event.new_text:
                return None  # held back: it may still become markup
            if not update and lp is None:
                update = {"content": ""}  # a token whose text is not complete yet
            return streamed | {"choices": [_chunk_choice(c, update, lp)]}

        def final(c: _Choice):
            reason = readers[c.index].finish_reason(readers[c.index].text, c.finish_reason)
            choice = _chunk_choice(c, {}) | {"finish_reason": reason, "stop_reason": c.stop_reason}
            return streamed | {"choices": [choice]}

        def _chunk_choice(c: _Choice, delta: dict, lp: dict | None = None) -> dict:
            return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": None}

        def whole():
            choices = []
            for c in call.choices:
                reader = readers[c.index]
                message = shown(reader.message(c.text, role))
                if echo:
                    message["content"] = echo + (message["content"] or "")
                choice = {
                    "index": c.index,
                    "message": message,
                    "logprobs": logprobs_body(c.token_ids, c.logprobs),
                    "finish_reason": reader.finish_reason(c.text, c.finish_reason),
                    "stop_reason": c.stop_reason,
                }
                if body.return_token_ids:
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
            out = head | {"choices": choices, "usage": call.usage()}
            first = call.choices[0]
            out["prompt_logprobs"] = _prompt_logprobs_field(body, first)
            if body.return_token_ids:
                out["prompt_token_ids"] = first.prompt_ids
            return out

        return await _respond(body, request, call, _Chunks(streamed, open_, delta, final), whole)

    return app


def tokenizer_config(model_dir: Path) -> dict:
    """A checkpoint's ``tokenizer_config.json`` ({} without one)."""
    path = Path(model_dir) / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
