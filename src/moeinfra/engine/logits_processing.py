"""Per-request changes to the logits before a token is drawn, in vLLM's order: the ``min_tokens``
mask, ``allowed_token_ids``, ``bad_words``, ``logit_bias``, then the repetition, frequency and
presence penalties (:class:`~moeinfra.engine.params.SamplingParams` says what each does).

Only rows whose request asks for one of them are touched (one Python pass per such row, a few
index operations on the vocabulary each), so a batch of plain requests costs nothing here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from moeinfra.engine.sequence import Sequence


def bad_word_ids(tokenizer, words: Iterable[str]) -> tuple[tuple[int, ...], ...]:
    """Token ids of each bad word as the output could spell it, with and without a leading space
    (as vLLM tokenises them)."""
    found = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in found:
                found.append(ids)
    return tuple(found)


def process_logits(
    logits: torch.Tensor, rows: list[tuple[int, Sequence, list[int]]], eos_token_ids
) -> None:
    """Change ``logits [R, V]`` in place. ``rows``: ``(row, request, tokens)`` where ``tokens``
    are the outputs the request will have generated before that row's token (its outputs, then
    the drafts a verification step accepted before it)."""
    vocab = logits.shape[1]
    for row, seq, history in rows:
        params = seq.params
        x = logits[row]
        if len(history) < params.min_tokens:  # vLLM's rule: no EOS or stop token before it
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned |= eos_token_ids
            x[[t for t in banned if t < vocab]] = -math.inf
        if not params.processes_logits:
            continue
        if params.allowed_token_ids is not None:
            allowed = [t for t in params.allowed_token_ids if t < vocab]
            kept = x[allowed].clone()
            x.fill_(-math.inf)
            x[allowed] = kept
        for word in seq.bad_word_ids:
            if (
                len(history) >= len(word) - 1
                and tuple(history[len(history) - len(word) + 1 :]) == word[:-1]
            ):
                x[word[-1]] = -math.inf
        if params.logit_bias:
            ids, bias = zip(*params.logit_bias, strict=True)
            x[list(ids)] += torch.tensor(bias, dtype=x.dtype, device=x.device)
        if params.repetition_penalty != 1.0:
            seen = np.union1d(seq.prompt_token_set, history) if history else seq.prompt_token_set
            ids = torch.from_numpy(seen).to(x.device)
            picked = x[ids]
            penalty = params.repetition_penalty
            x[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
        if (params.frequency_penalty or params.presence_penalty) and history:
            ids, counts = np.unique(np.asarray(history, dtype=np.int64), return_counts=True)
            change = params.frequency_penalty * counts + params.presence_penalty
            x[torch.from_numpy(ids).to(x.device)] -= torch.from_numpy(change).to(x)
