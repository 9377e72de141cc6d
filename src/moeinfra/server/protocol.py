"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``, as vLLM's OpenAI server
takes them: every field vLLM knows is declared here, and each is either honoured with vLLM's
meaning or refused with a 400 naming it (:data:`REFUSED`) — never accepted and ignored. A field
no OpenAI-compatible server knows is ignored with a warning, as vLLM does.

:func:`sampling_params` turns a request into the engine's
:class:`~moeinfra.engine.params.SamplingParams`.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moeinfra.engine.params import MAX_LOGPROBS, SamplingParams
from moeinfra.errors import InputError

log = logging.getLogger(__name__)

_INT64 = 2**63


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


def refuse(name: str, why: str) -> APIError:
    return APIError(400, f"{name}: {why}", name)


class StreamOptions(BaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _Request(BaseModel):
    """Fields both endpoints take (vLLM 0.12's names, types and defaults)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # fast tokenizers have no such choice (as vLLM)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    echo: bool | None = False
    add_special_tokens: bool | None = None
    user: str | None = None  # an end user's id: for the operator's logs, no effect on output
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    # refused (see REFUSED)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    priority: int = 0
    logits_processors: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    best_of: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown(cls, data):
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                log.warning("fields present in the request but ignored: %s", ", ".join(unknown))
        return data

    def stream_usage(self) -> tuple[bool, bool]:
        """(a final usage chunk, usage on every chunk) of a streamed response."""
        options = self.stream_options
        if options is None:
            return False, False
        return bool(options.include_usage), bool(options.continuous_usage_stats)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    logprobs: int | None = None
    suffix: str | None = None
    prompt_embeds: Any = None


class ChatRequest(_Request):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    bad_words: list[str] = []
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    # refused (see REFUSED)
    reasoning_effort: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    modalities: list[str] | None = None


#: Fields known to vLLM (or the OpenAI API) that this server does not implement: a request that
#: sets one to anything but its default gets a 400 naming it. ``(field, default, why)``.
REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("use_beam_search", False, "beam search is not supported"),
    ("length_penalty", 1.0, "applies to beam search, which is not supported"),
    ("priority", 0, "priority scheduling is not enabled (requests run in arrival order)"),
    ("logits_processors", None, "per-request logits processors are not supported"),
    ("cache_salt", None, "prefix-cache isolation by salt is not supported"),
    ("kv_transfer_params", None, "external KV connectors are not supported"),
    ("vllm_xargs", None, "no extension arguments are defined"),
    ("suffix", None, "suffix is not currently supported"),
    ("prompt_embeds", None, "prompt embeddings are not supported"),
    ("guided_decoding_backend", None, "the structured-output backend is the server's "
     "(llguidance), not chosen per request"),
    ("reasoning_effort", None, "DeepSeek models take no reasoning effort; use "
     "chat_template_kwargs such as {\"thinking\": true}"),
    ("chat_template", None, "a request's own chat template is not trusted (the checkpoint's "
     "template is used)"),
    ("mm_processor_kwargs", None, "the model takes text only"),
    ("functions", None, "the deprecated functions API is not supported; use tools"),
    ("function_call", None, "the deprecated functions API is not supported; use tool_choice"),
    ("audio", None, "the model takes and gives text only"),
    ("prediction", None, "predicted outputs are not supported"),
    ("web_search_options", None, "web search is not supported"),
)  # fmt: skip


def check_refused(body: _Request) -> None:
    """Raise an :class:`APIError` for the first field of :data:`REFUSED` the request sets."""
    for name, default, why in REFUSED:
        value = getattr(body, name, default)
        if value != default and not (value == [] and default is None):
            raise refuse(name, why)
    if isinstance(body, ChatRequest) and body.modalities not in (None, ["text"]):
        raise refuse("modalities", "the model gives text only")
    if body.best_of is not None and body.best_of not in (1, body.n):
        raise refuse("best_of", f"best_of={body.best_of} above n={body.n} is not supported")


def requested_n(body: _Request, max_n: int) -> int:
    n = 1 if body.n is None else body.n
    if not 1 <= n <= max_n:
        raise APIError(400, f"n={n} must be in 1..{max_n}", "n")
    return n


def logprobs_of(body: _Request) -> int | None:
    """Top log-probabilities per output token the request asks for (None: none)."""
    if isinstance(body, ChatRequest):
        top = body.top_logprobs or 0
        if top < 0 or top > MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs={top} must be in 0..{MAX_LOGPROBS}", "top_logprobs")
        if top and not body.logprobs:
            raise APIError(
                400, "top_logprobs needs logprobs=true (when using top_logprobs)", "top_logprobs"
            )
        return top if body.logprobs else None
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs={body.logprobs} must be in 0..{MAX_LOGPROBS}", "logprobs")
    return body.logprobs


def prompt_logprobs_of(body: _Request) -> int | None:
    """Top log-probabilities per prompt token: the request's ``prompt_logprobs``, or with
    ``echo`` its ``logprobs`` (the echoed prompt's tokens carry them, as in vLLM)."""
    asked = body.prompt_logprobs
    if asked is not None and body.stream and asked > 0:
        raise APIError(400, "prompt_logprobs are not available when stream=true", "prompt_logprobs")
    if asked is None and body.echo:
        top = logprobs_of(body)
        if top is not None:
            return top
    return asked


def sampling_params(
    body: _Request,
    max_tokens: int,
    seed_offset: int,
    prompt_logprobs: int | None,
    grammar: str | None = None,
    grammar_after: str | None = None,
) -> SamplingParams:
    """The engine's parameters for one choice of ``body`` (``max_tokens`` resolved already)."""
    seed = None if body.seed in (None, -1) else body.seed + seed_offset
    if seed is not None:
        seed %= 2**64
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            max_tokens=max_tokens,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            seed=seed,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=body.logit_bias,
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words if isinstance(body, ChatRequest) else None,
            logprobs=logprobs_of(body),
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            grammar=grammar,
            grammar_after=grammar_after if grammar is not None else None,
        )
    except InputError as err:
        raise APIError(400, str(err), str(err).split("=", 1)[0].split(" ", 1)[0]) from None


def check_token_ids(params: SamplingParams, vocab: int) -> None:
    """A 400 naming the field whose token id is outside the model's vocabulary."""
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("logit_bias", [t for t, _ in params.logit_bias]),
    ):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise APIError(
                400, f"{name}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", name
            )


def truncated(body: _Request, ids: list[int], max_model_len: int) -> list[int]:
    """The prompt's last ``truncate_prompt_tokens`` tokens (-1: ``max_model_len``), as vLLM."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens=0 must be >= 1 or -1", "truncate_prompt_tokens")
    if keep > max_model_len:
        raise APIError(
            400,
            f"truncate_prompt_tokens={keep} is greater than max_model_len={max_model_len}",
            "truncate_prompt_tokens",
        )
    return ids[-keep:]


def message_text(content: Any) -> str:
    """A message's content as the chat template takes it: text parts joined with newlines (vLLM's
    "string" content format); None is the empty string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of content parts", "messages")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text", "refusal", "thinking"):
            texts.append(str(part.get(kind if kind in ("refusal", "thinking") else "text") or ""))
        else:
            raise APIError(
                400, f"content part of type {kind!r} is not supported (the model reads text)",
                "messages",
            )  # fmt: skip
    return "\n".join(texts)
