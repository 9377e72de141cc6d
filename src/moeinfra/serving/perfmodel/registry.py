"""Architectures' cost terms by ``config.json``'s ``model_type``, as the engine keeps their models
(:mod:`moeinfra.engine.registry`).

A :class:`CostTerms` says what one architecture's layers cost; the step model
(:class:`~moeinfra.serving.perfmodel.step.PerfModel`) adds the parts every architecture shares.
Built in: ``deepseek_v3``, ``deepseek_v32`` (V3 with DeepSeek Sparse Attention) and
``deepseek_v4`` (window and compressed attention by layer kind, FP4 experts); another architecture
is a module of its own, registered here (:func:`register`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moeinfra.errors import InputError


@dataclass(frozen=True)
class CostTerms:
    """One architecture's terms, in seconds per micro-batch unless said, for a unit ``perf`` (a
    :class:`~moeinfra.serving.perfmodel.step.PerfModel`); token arguments broadcast.

    ``prefill_attention(perf, tokens, keys, cached_per_token, sm, combine)``: (attention
    projections, core attention, indexer) of a prefill micro-batch of ``tokens`` tokens per GPU
    attending to ``keys`` keys each, with ``cached_per_token`` cache hits per token, its GEMMs on
    the ``sm`` share of the SMs, beside the other micro-batch's ``combine`` seconds; each a float,
    or ``[layers]`` where layers differ; the indexer None without one.
    ``decode_attention(perf, tokens, kv, requests)``: (core attention, indexer) of ``tokens`` query
    rows of ``requests`` requests at ``kv`` cached tokens each; ``{layer kind: seconds}`` where
    layers differ; the indexer None without one.
    ``layer_values(model, term)``: such a term per layer (``[layers]``), or as it is where every
    layer is alike.
    ``decode_layers_s(perf, mb, parts)``: seconds of every layer of a decode step of ``mb``
    micro-batches of :class:`~moeinfra.serving.perfmodel.breakdown.DecodeParts` ``parts``.
    ``decode_projections(perf, tokens)``: the attention's weight GEMMs in decode.
    ``routed(perf, phase, tokens, sm_fraction)``: the heaviest GPU's routed-expert GEMMs for
    ``tokens`` tokens per GPU in ``phase`` (``"prefill"`` or ``"decode"``).
    ``attention_weight(perf, keys)``: relative prefill cost per token of the work that grows with
    the ``keys`` it attends to (``PerfModel.prefill_attention_weight``).
    ``weight_bytes(model, slots_per_gpu)``: bytes of the weights one GPU holds with
    ``slots_per_gpu`` routed-expert slots per layer.
    ``activation_bytes(model, tokens)``: bytes of the residual stream and the attention heads'
    activations of a micro-batch of ``tokens`` tokens.
    """

    model_type: str
    prefill_attention: Callable
    decode_attention: Callable
    layer_values: Callable
    decode_layers_s: Callable
    decode_projections: Callable
    routed: Callable
    attention_weight: Callable
    weight_bytes: Callable
    activation_bytes: Callable


_REGISTRY: dict[str, CostTerms] = {}


def register(terms: CostTerms) -> None:
    """Make ``terms`` the cost terms of its ``model_type``."""
    _REGISTRY[terms.model_type] = terms


def _builtin() -> None:
    from moeinfra.serving.perfmodel import deepseek_v3, deepseek_v4, deepseek_v32

    for module in (deepseek_v3, deepseek_v32, deepseek_v4):
        register(module.COSTS)


def cost_terms(model_type: str) -> CostTerms:
    """The registered cost terms of ``model_type``; an InputError names the others."""
    if not _REGISTRY:
        _builtin()
    if model_type not in _REGISTRY:
        raise InputError(
            f"model_type={model_type!r} has no serving cost terms; use one of {sorted(_REGISTRY)}"
        )
    return _REGISTRY[model_type]
