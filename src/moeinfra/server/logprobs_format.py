"""Log-probabilities in the shapes of the OpenAI API as vLLM serves them.

* completions (``logprobs`` 0..20): ``tokens``, ``token_logprobs``, ``top_logprobs`` (per token, a
  ``{token text: logprob}`` dict of the chosen token and the ``logprobs`` most likely ones, so
  ``logprobs + 1`` entries when the chosen one is not among them) and ``text_offset``
  (characters before each token in the choice's text); an echoed prompt's first token has
  ``None`` for both logprob fields;
* chat (``logprobs`` + ``top_logprobs`` 0..20): ``content`` of ``{token, logprob, bytes,
  top_logprobs}``, the latter the ``top_logprobs`` most likely tokens;
* ``prompt_logprobs``: per prompt token ``None`` (the first) or ``{token id: {logprob, rank,
  decoded_token}}``, the prompt's token first, then the most likely ones.

Log-probabilities below -9999 (a masked token's -inf) are shown as -9999, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence

from moeinfra.engine.outputs import Logprobs

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


class TokenNames:
    """How tokens are written: their text, or ``token_id:N`` (``return_tokens_as_token_ids``)."""

    def __init__(self, tokenizer, as_ids: bool) -> None:
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tokenizer.token_text(token_id)


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Logprobs | None],
    name: TokenNames,
    text_offset: int = 0,
) -> dict:
    """The ``logprobs`` object of a completion choice (or of one streamed chunk of it, its text
    starting ``text_offset`` characters into the choice)."""
    out: dict[str, list] = {
        "text_offset": [],
        "token_logprobs": [],
        "tokens": [],
        "top_logprobs": [],
    }
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = name(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_value(entry.logprob))
        top = {text: _value(entry.logprob)}
        for other, logprob in zip(entry.top_ids, entry.top_logprobs, strict=True):
            top.setdefault(name(other), _value(logprob))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[Logprobs], name: TokenNames, tokenizer
) -> dict:
    """The ``logprobs`` object of a chat choice (or chunk)."""

    def item(token_id: int, logprob: float) -> dict:
        raw = list(tokenizer.token_bytes(token_id)) if not name.as_ids else None
        return {"token": name(token_id), "logprob": _value(logprob), "bytes": raw}

    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        head = item(token_id, entry.logprob)
        head["top_logprobs"] = [
            item(other, logprob)
            for other, logprob in zip(entry.top_ids, entry.top_logprobs, strict=True)
        ]
        content.append(head)
    return {"content": content}


def prompt_logprobs(entries: Sequence[Logprobs], tokenizer) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then one dict per token."""
    out: list[dict | None] = [None]
    for entry in entries:
        position = {
            str(entry.token_id): {
                "logprob": _value(entry.logprob),
                "rank": entry.rank,
                "decoded_token": tokenizer.token_text(entry.token_id),
            }
        }
        for rank, (other, logprob) in enumerate(
            zip(entry.top_ids, entry.top_logprobs, strict=True), start=1
        ):
            position.setdefault(
                str(other),
                {
                    "logprob": _value(logprob),
                    "rank": rank,
                    "decoded_token": tokenizer.token_text(other),
                },
            )
        out.append(position)
    return out
