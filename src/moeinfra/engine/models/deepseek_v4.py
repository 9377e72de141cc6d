"""DeepSeek-V4 (``model_type: deepseek_v4``): hybrid compressed attention, mHC, hash routing.

Per layer, shared-KV multi-query attention (one ``head_dim`` key that is also the value) over

- a sliding window: the last ``sliding_window`` tokens (every layer);
- compressed entries (``compress_ratio`` m > 0): one per window of m tokens, a softmax-gated sum of
  the window's projected keys (CSA, m = 4: over two overlapping windows, and a lightning indexer
  picks each query's ``index_topk`` entries; HCA, m = 128: all entries visible);

with per-head attention sinks, partial interleaved RoPE on the trailing ``qk_rope_head_dim`` dims
(undone on the output), and a grouped low-rank output projection. The residual is ``hc_mult``
streams mixed by manifold-constrained hyper-connections (Sinkhorn-projected); every layer is MoE,
its first ``num_hash_layers`` routed by a fixed token -> experts table (``tid2eid``).

Cache (:func:`kv_layout`): a running request holds its last ``sliding_window - 1`` window keys and
its open compression windows' projections; the paged cache holds the compressed entries (a
``1/ratio`` slice per token) and, per block, CSA's tail and the window keys before the block's end —
so a request can resume from the cache alone at any block boundary (prefix hits, preemption, KV
handed over). Blocks hold whole compression windows and at least a sliding window.

Checkpoint names: DeepSeek's (``layers.N.attn.wq_a.weight``, ``embed.weight``, ``head.weight``,
``hc_head_fn``) or transformers' (the same under ``model.``, ``model.embed_tokens.weight``,
``model.hc_head.hc_fn``); the MTP layers (``mtp.*``) are not loaded.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeinfra.engine.checkpoint import CheckpointReader
from moeinfra.engine.hf_config import CSA, HCA, SLIDING, ModelConfig, V4Attention, model_fields
from moeinfra.engine.kv_cache import KVLayout, LayerCache, StepCache, gather
from moeinfra.eplb import Plan
from moeinfra.errors import CheckpointError
from moeinfra.moe.comm import Communicator
from moeinfra.moe.config import MoEConfig
from moeinfra.moe.expert_parallel import ExpertParallelMoE, rank_experts
from moeinfra.moe.gate import expert_scores
from moeinfra.moe.layers import Expert, Linear, RMSNorm
from moeinfra.moe.mla import Segment
from moeinfra.moe.rope import RotaryTable, Yarn, inverse_frequencies, rotate_cis
from moeinfra.moe.runtime import ExpertParallelDecoder

MODEL_TYPE = "deepseek_v4"

# compress_ratios (DeepSeek's config) -> layer kind, as transformers reads them
_KIND_OF_RATIO = {0: SLIDING, 4: CSA, 128: HCA}

# cache parts per token per layer (widths in :func:`kv_layout`)
WINDOW_KV, ENTRY, INDEX_ENTRY, TAIL = "kv", "entry", "index_entry", "tail"


def _positive(raw: dict, key: str, source: str) -> int:
    if key not in raw:
        raise CheckpointError(f"{source}: required key {key!r} is missing")
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{source}: {key}={value!r} must be an integer > 0")
    return value


def _layer_kinds(raw: dict, n: int, source: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Per layer ``(kind, ratio)`` from transformers' ``layer_types`` + ``compress_rates`` or
    DeepSeek's ``compress_ratios``."""
    if raw.get("layer_types") is not None:
        kinds = tuple(raw["layer_types"])[:n]
        rates = {CSA: 4, HCA: 128} | dict(raw.get("compress_rates") or {})
        for kind in kinds:
            if kind not in (SLIDING, CSA, HCA):
                raise CheckpointError(
                    f"{source}: layer_types entry {kind!r} is not one of {SLIDING}, {CSA}, {HCA}"
                )
        for kind in (CSA, HCA):
            rate = rates[kind]
            if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
                raise CheckpointError(f"{source}: compress_rates[{kind!r}]={rate!r} must be >= 1")
        ratios = tuple(0 if k == SLIDING else rates[k] for k in kinds)
    elif raw.get("compress_ratios") is not None:
        ratios = tuple(raw["compress_ratios"])[:n]
        for r in ratios:
            if r not in _KIND_OF_RATIO:
                raise CheckpointError(
                    f"{source}: compress_ratios value {r!r} is not one of "
                    f"{sorted(_KIND_OF_RATIO)} (0: sliding window only, 4: CSA, 128: HCA)"
                )
        kinds = tuple(_KIND_OF_RATIO[r] for r in ratios)
    else:
        raise CheckpointError(
            f"{source}: required key 'layer_types' (or 'compress_ratios') is missing"
        )
    if len(kinds) != n:
        raise CheckpointError(
            f"{source}: {len(kinds)} layer types for num_hidden_layers={n}; give one per layer"
        )
    return kinds, ratios


def _rope(raw: dict, source: str) -> tuple[float, float, Yarn | None]:
    """``(rope_theta, compress_rope_theta, yarn of the compressed layers)``."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict):
        main, compress = params["main"], params["compress"]
        theta, compress_theta = float(main["rope_theta"]), float(compress["rope_theta"])
        scaling = compress
    else:
        theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
        compress_theta = float(raw.get("compress_rope_theta", 160000.0))
        scaling = raw.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, compress_theta, None
    if kind != "yarn":
        raise CheckpointError(f"{source}: rope type {kind!r} is not supported; use 'yarn' or none")
    # V4 does not scale cos/sin by YaRN's attention factor (transformers forces it to 1)
    return theta, compress_theta, dataclasses.replace(Yarn.from_hf(scaling), mscale=0.0)


def parse_config(raw: dict, source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` whose ``block`` holds V4's MoE sizes and ``v4`` its attention."""
    try:
        n = _positive(raw, "num_hidden_layers", source)
        head_dim = _positive(raw, "head_dim", source)
        rope_dim = raw.get("qk_rope_head_dim")
        if rope_dim is None:
            rope_dim = int(head_dim * float(raw.get("partial_rotary_factor") or 64 / 512))
        window = raw.get("sliding_window")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise CheckpointError(f"{source}: sliding_window={window!r} must be an integer >= 1")
        kinds, ratios = _layer_kinds(raw, n, source)
        if raw.get("mlp_layer_types") is not None:
            hashed = tuple(t == "hash_moe" for t in raw["mlp_layer_types"][:n])
        else:
            hashed = tuple(i < int(raw.get("num_hash_layers", 3)) for i in range(n))
        theta, compress_theta, yarn = _rope(raw, source)
        heads = _positive(raw, "num_attention_heads", source)
        groups = _positive(raw, "o_groups", source)
        if heads % groups:
            raise CheckpointError(
                f"{source}: o_groups={groups} must divide num_attention_heads={heads}"
            )
        v4 = V4Attention(
            head_dim=head_dim,
            rope_dim=int(rope_dim),
            o_groups=groups,
            o_lora_rank=_positive(raw, "o_lora_rank", source),
            sliding_window=window,
            layer_kinds=kinds,
            compress_ratios=ratios,
            index_heads=_positive(raw, "index_n_heads", source),
            index_head_dim=_positive(raw, "index_head_dim", source),
            index_topk=_positive(raw, "index_topk", source),
            hc_mult=_positive(raw, "hc_mult", source),
            hc_sinkhorn_iters=_positive(raw, "hc_sinkhorn_iters", source),
            hc_eps=float(raw.get("hc_eps", 1e-6)),
            rope_theta=theta,
            compress_rope_theta=compress_theta,
            yarn=yarn,
            hash_layers=hashed,
        )
        block = MoEConfig(
            hidden_size=int(raw["hidden_size"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            num_routed_experts=int(raw["n_routed_experts"]),
            num_shared_experts=int(raw.get("n_shared_experts") or 0),
            experts_per_token=int(raw["num_experts_per_tok"]),
            num_expert_groups=1,
            groups_per_token=1,
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            scoring=raw.get("scoring_func", "sqrtsoftplus"),
            norm_topk_prob=True,
            num_attention_heads=heads,
            q_lora_rank=_positive(raw, "q_lora_rank", source),
            num_layers=n,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            swiglu_limit=raw.get("swiglu_limit"),
        )
        config = ModelConfig(
            model_type=raw["model_type"],
            block=block,
            num_layers=n,
            first_k_dense_replace=0,
            intermediate_size=block.moe_intermediate_size,
            **model_fields(raw),
            v4=v4,
        )
    except KeyError as exc:
        raise CheckpointError(f"{source}: required key {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{source}: {exc}") from None
    for kind, ratio in zip(v4.layer_kinds, v4.compress_ratios, strict=True):
        dims = (("head_dim", v4.head_dim),) + (
            (("index_head_dim", v4.index_head_dim),) if kind == CSA else ()
        )
        for name, dim in dims:
            if ratio and dim % ratio:
                raise CheckpointError(
                    f"{source}: {name}={dim} must be a multiple of the compress ratio {ratio} "
                    "(a window's tokens each cache a 1/ratio slice of its entry)"
                )
    return config


def checkpoint_tokens(config: ModelConfig, block_size: int) -> int:
    """Positions at which a sequence can resume from the cache alone (a prefix hit, preemption,
    KV handed over): every block boundary. The window before a boundary is kept in the block that
    ends there — the one block only this prefix owns (blocks before it may be shared by prompts that
    part later); blocks of at least ``4 x sliding_window`` tokens keep that share small."""
    return block_size


def kv_layout(config: ModelConfig, dtype: torch.dtype, block_size: int) -> KVLayout:
    """Per token, each layer's parts (named ``part.layer``, one row of them: the layers differ):
    every layer's share of its block's window checkpoint (the last ``sliding_window - 1`` window
    keys before the block's end, spread over the block's tokens: :func:`checkpoint_tokens`); a
    compressed layer's ``1 / ratio`` slice of the entry of the token's window (the window's
    ``ratio`` tokens hold it together); a CSA layer's same slice of the indexer's key and
    ``1 / block_size`` share of the block's *tail* — the projections of its last window that the
    next window's overlapping compression reads (:func:`tail_values`)."""
    v4 = config.v4
    window_values = (v4.sliding_window - 1) * v4.head_dim
    window_share = max(1, -(-window_values // block_size))
    parts = []
    for i, (kind, ratio) in enumerate(zip(v4.layer_kinds, v4.compress_ratios, strict=True)):
        parts.append((f"{WINDOW_KV}.{i}", window_share))
        if ratio:
            parts.append((f"{ENTRY}.{i}", v4.head_dim // ratio))
        if kind == CSA:
            parts += [
                (f"{INDEX_ENTRY}.{i}", v4.index_head_dim // ratio),
                (f"{TAIL}.{i}", -(-tail_values(v4) // block_size)),
            ]
    return KVLayout(tuple(parts), 1, dtype)


def _csa_ratio(v4: V4Attention) -> int:
    return next(r for k, r in zip(v4.layer_kinds, v4.compress_ratios, strict=True) if k == CSA)


def tail_values(v4: V4Attention) -> int:
    """Values of a CSA layer's block tail: the first halves of its last window's compressor key and
    gate projections (``ratio x head_dim`` each) and of the indexer's (``ratio x index_head_dim``)."""
    return _csa_ratio(v4) * 2 * (v4.head_dim + v4.index_head_dim)


def state_bytes_per_request(config: ModelConfig, dtype: torch.dtype) -> int:
    """The most bytes a running request keeps outside the cache: per layer its window's last
    ``sliding_window - 1`` keys; per compressed layer the open window's projections (``ratio - 1``
    tokens) and, with CSA's overlap, the last whole window's (``ratio``), each a key and a gate of
    ``2 * head_dim`` (CSA, plus the indexer's ``2 * index_head_dim``) or ``head_dim`` (HCA)."""
    v4, itemsize = config.v4, torch.empty(0, dtype=dtype).element_size()
    values = config.num_layers * (v4.sliding_window - 1) * v4.head_dim
    for kind, ratio in zip(v4.layer_kinds, v4.compress_ratios, strict=True):
        if kind == CSA:
            values += (2 * ratio - 1) * 2 * 2 * (v4.head_dim + v4.index_head_dim)
        elif kind == HCA:
            values += (ratio - 1) * 2 * v4.head_dim
    return values * itemsize


def default_block_size(config: ModelConfig) -> int:
    """The least multiple of the engine's 64 tokens that holds whole compression windows and four
    sliding windows (a block keeps the window before its end: the larger the block, the smaller
    that share per token): 512 for DeepSeek-V4-Flash and -Pro."""
    block = math.lcm(64, *config.v4.ratios)
    return -(-4 * config.v4.sliding_window // block) * block


def check_block_size(config: ModelConfig, block_size: int) -> None:
    """Blocks hold whole compression windows (a shared prefix ends on a window boundary) and at
    least a sliding window (a block keeps the window before its end)."""
    v4 = config.v4
    for ratio in v4.ratios:
        if block_size % ratio:
            raise CheckpointError(
                f"block_size={block_size} must be a multiple of every compress ratio "
                f"{list(v4.ratios)} (DeepSeek-V4 blocks hold whole compression windows)"
            )
    if block_size < v4.sliding_window:
        raise CheckpointError(
            f"block_size={block_size} must be at least sliding_window={v4.sliding_window} "
            "(a DeepSeek-V4 block keeps the window before its end)"
        )


# ---------------------------------------------------------------------------------------- modules
def _head_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim without a weight (V4's per-head query norm and mHC input)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Rope:
    """Partial interleaved RoPE on the trailing ``dim`` values of a vector."""

    def __init__(self, dim: int, theta: float, yarn: Yarn | None) -> None:
        self.dim = dim
        self.table = RotaryTable(inverse_frequencies(dim, theta, yarn))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False):
        """``x [T, ..., D]`` rotated at ``positions [T]`` (``inverse``: by minus the angle)."""
        cis = self.table.cis(positions)
        if inverse:
            cis = cis.conj()
        rotated = rotate_cis(x[..., -self.dim :], cis)
        return torch.cat([x[..., : -self.dim], rotated], dim=-1)


class Compressor(nn.Module):
    """Compresses each window of ``ratio`` tokens into one ``dim`` entry: softmax over the window
    (per channel) of the projected gate plus a learned position bias, weighting the projected keys;
    with ``overlap`` (CSA) over ``2 * ratio`` slots, the previous window's first-half projections
    beside this window's second half."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = (2 if overlap else 1) * dim
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.wkv = Linear(hidden, width)
        self.wgate = Linear(hidden, width)
        self.ape = nn.Parameter(torch.zeros(ratio, width))
        self.norm = RMSNorm(dim, eps)

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, first: int) -> torch.Tensor:
        """Entries of windows ``first .. first + n - 1`` from the projections of their tokens,
        ``kv, gate [(n + o) * ratio, width]`` starting at window ``first - o`` (``o = 1`` with
        overlap when ``first > 0``, else 0) -> ``[n, dim]`` (not yet rotated)."""
        m, d = self.ratio, self.dim
        kv = kv.view(-1, m, kv.shape[-1])
        gate = gate.view(-1, m, gate.shape[-1]).float() + self.ape.float()
        if not self.overlap:
            weights = gate.softmax(dim=1).to(kv.dtype)
            return self.norm((kv * weights).sum(dim=1))
        prior = 1 if first > 0 else 0
        n = kv.shape[0] - prior
        slots_kv = kv.new_zeros(n, 2 * m, d)
        slots_gate = gate.new_full((n, 2 * m, d), float("-inf"))
        slots_kv[:, m:], slots_gate[:, m:] = kv[prior:, :, d:], gate[prior:, :, d:]
        # window w's first half: window w - 1's first-half projections (none before window 0)
        slots_kv[1 - prior :, :m] = kv[: n - 1 + prior, :, :d]
        slots_gate[1 - prior :, :m] = gate[: n - 1 + prior, :, :d]
        weights = slots_gate.softmax(dim=1).to(kv.dtype)
        return self.norm((slots_kv * weights).sum(dim=1))


class Indexer(nn.Module):
    """CSA's lightning indexer: its own compressor at ``index_head_dim`` and
    ``sum_h w_h ReLU(q_h . k) / sqrt(index_head_dim)`` scores over the compressed keys."""

    def __init__(self, hidden: int, q_lora_rank: int, v4: V4Attention, ratio: int, eps: float):
        super().__init__()
        self.heads, self.dim = v4.index_heads, v4.index_head_dim
        self.compressor = Compressor(hidden, self.dim, ratio, True, eps)
        self.wq_b = Linear(q_lora_rank, self.heads * self.dim)
        self.weights_proj = Linear(hidden, self.heads)

    def scores(self, x: torch.Tensor, q_residual: torch.Tensor, keys: torch.Tensor, rope, pos):
        """``[L, T]`` float32 scores of ``L`` queries over ``T`` compressed keys (``keys [T, d]``
        shared, or ``[L, T, d]`` each query's own)."""
        q = rope(self.wq_b(q_residual).view(-1, self.heads, self.dim), pos).float()
        shared = "td" if keys.dim() == 2 else "ltd"
        s = F.relu(torch.einsum(f"lhd,{shared}->lht", q, keys.float())) * self.dim**-0.5
        w = self.weights_proj(x).float() * self.heads**-0.5
        return (s * w[..., None]).sum(dim=1)


class V4AttentionLayer(nn.Module):
    """One layer's attention (window + its compressed entries), reading and writing the paged
    cache; ``forward(x [T, H], segments, cache) -> [T, H]``."""

    def __init__(self, block: MoEConfig, v4: V4Attention, layer: int, ropes: dict) -> None:
        super().__init__()
        h, hd, heads = block.hidden_size, v4.head_dim, block.num_attention_heads
        self.v4, self.heads, self.head_dim, self.eps = v4, heads, hd, block.rms_norm_eps
        self.kind, self.ratio = v4.layer_kinds[layer], v4.compress_ratios[layer]
        self.layer = layer
        self.wq_a = Linear(h, block.q_lora_rank)
        self.q_norm = RMSNorm(block.q_lora_rank, block.rms_norm_eps)
        self.wq_b = Linear(block.q_lora_rank, heads * hd)
        self.wkv = Linear(h, hd)
        self.norm = RMSNorm(hd, block.rms_norm_eps)
        self.wo_a = Linear(heads * hd // v4.o_groups, v4.o_groups * v4.o_lora_rank)
        self.wo_b = Linear(v4.o_groups * v4.o_lora_rank, h)
        self.attn_sink = nn.Parameter(torch.zeros(heads))
        self.compressor = (
            Compressor(h, hd, self.ratio, self.kind == CSA, block.rms_norm_eps)
            if self.ratio
            else None
        )
        self.indexer = (
            Indexer(h, block.q_lora_rank, v4, self.ratio, block.rms_norm_eps)
            if self.kind == CSA
            else None
        )
        self.rope = ropes["main" if self.kind == SLIDING else "compress"]
        self.compress_rope = ropes["compress"]
        self.held: dict[int, _Held] = {}

    def forward(self, x: torch.Tensor, segments: list[Segment], cache: LayerCache) -> torch.Tensor:
        q_residual = self.q_norm(self.wq_a(x))
        q = _head_rms(self.wq_b(q_residual).view(-1, self.heads, self.head_dim), self.eps)
        out = torch.empty_like(q)
        starts = [0]
        for s in segments:
            starts.append(starts[-1] + s.length)
        decode = [i for i, s in enumerate(segments) if s.length == 1]
        if len(decode) < 2:  # a lone decode token goes alone
            decode = []
        if decode:  # one token each: their attention as one batch
            at = torch.tensor([starts[i] for i in decode], device=x.device)
            batch = [segments[i] for i in decode]
            out[at] = self._decode(x[at], q[at], q_residual[at], batch, cache)
        batched = set(decode)
        for i, s in enumerate(segments):
            if i in batched:
                continue
            rows = slice(starts[i], starts[i + 1])
            pos = torch.arange(s.start, s.start + s.length, device=x.device)
            out[rows] = self._segment(x[rows], q[rows], q_residual[rows], pos, s, cache)
        g = self.v4.o_groups
        grouped = out.reshape(-1, g, self.heads * self.head_dim // g)
        w = self.wo_a.weight.view(g, -1, grouped.shape[-1])
        mixed = torch.einsum("tgi,gri->tgr", grouped, w).flatten(1)
        return self.wo_b(mixed)

    def _segment(self, x, q, q_residual, pos, s: Segment, cache: LayerCache) -> torch.Tensor:
        slots = cache.step.slots[s.seq]
        end, window = s.start + s.length, self.v4.sliding_window
        q = self.rope(q, pos)
        held = self._resume(s.seq, s.start, slots, cache)
        keys = torch.cat([held.window, self.rope(self.norm(self.wkv(x)), pos)])
        first = s.start - held.window.shape[0]
        self._write_checkpoints(s, keys, first, slots, cache)
        kept = keys[max(0, keys.shape[0] - (window - 1)) :]
        key_pos = torch.arange(first, end, device=x.device)
        visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - window)
        chosen = chosen_visible = None
        rows_from, rows = 0, []
        if self.compressor is not None:
            entries, entry_visible, rows_from, rows = self._compressed(
                x, q_residual, pos, s, slots, cache, held
            )
            if entries.dim() == 2:  # every query sees the same entries (masked)
                keys = torch.cat([keys, entries])
                visible = torch.cat([visible, entry_visible], dim=1)
            else:  # each query's own top-k entries
                chosen, chosen_visible = entries.float(), entry_visible
        self.held[s.seq] = _Held(end, kept, rows_from, rows)
        out = self._attend(q, keys, visible, chosen, chosen_visible)
        return self.rope(out, pos, inverse=True)

    def _attend(self, q, keys, visible, chosen=None, chosen_visible=None) -> torch.Tensor:
        """Attention with the per-head sinks of the rotated queries ``q [L, heads, hd]`` over the
        shared-KV ``keys`` — ``[K, hd]`` for every query or ``[L, K, hd]`` each query's own —
        where ``visible [L, K]`` (None: all), and over each query's own ``chosen [L, E, hd]``
        entries (float32) where ``chosen_visible [L, E]`` -> ``[L, heads, hd]`` in ``q``'s dtype."""
        own = "kd" if keys.dim() == 2 else "lkd"
        scale, qf, kf = self.head_dim**-0.5, q.float(), keys.float()
        logits = [torch.einsum(f"lhd,{own}->lhk", qf, kf) * scale]
        if visible is not None:
            logits[0] = logits[0].masked_fill(~visible[:, None, :], float("-inf"))
        if chosen is not None:
            picked = torch.einsum("lhd,lkd->lhk", qf, chosen) * scale
            logits.append(picked.masked_fill(~chosen_visible[:, None, :], float("-inf")))
        logits.append(self.attn_sink.float().view(1, -1, 1).expand(qf.shape[0], -1, 1))
        probs = torch.cat(logits, dim=-1).softmax(dim=-1)
        n = keys.shape[-2]
        out = torch.einsum(f"lhk,{own}->lhd", probs[..., :n], kf)
        if chosen is not None:
            out = out + torch.einsum("lhk,lkd->lhd", probs[..., n:-1], chosen)
        return out.to(q.dtype)

    def _decode(self, x, q, q_residual, segs: list[Segment], cache: LayerCache) -> torch.Tensor:
        """:meth:`_segment` for requests of one new token each, as one batch: the window keys of
        every request side by side (left-padded while shorter than the window), the compressed
        entries of each (padded to the most any has; CSA: each query's top-k by the indexer)."""
        b, device = len(segs), x.device
        window, kept = self.v4.sliding_window, self.v4.sliding_window - 1
        pos = torch.tensor([s.start for s in segs], device=device)
        q = self.rope(q, pos)
        new = self.rope(self.norm(self.wkv(x)), pos)
        slots = [cache.step.slots[s.seq] for s in segs]
        held = [self._resume(s.seq, s.start, sl, cache) for s, sl in zip(segs, slots, strict=True)]
        lengths = [h.window.shape[0] for h in held]
        if all(n == kept for n in lengths):
            keys = torch.cat([torch.stack([h.window for h in held]), new[:, None]], dim=1)
            valid = None
        else:
            keys = new.new_zeros(b, window, self.head_dim)
            valid = torch.zeros(b, window, dtype=torch.bool, device=device)
            for i, h in enumerate(held):
                keys[i, kept - lengths[i] : kept] = h.window
                valid[i, kept - lengths[i] :] = True
            keys[:, -1] = new
        span = cache.step.cache.block_size
        rows_from, rows = [0] * b, [[] for _ in segs]
        entries = entry_valid = None
        if self.compressor is not None:
            rows_from, rows, entries, entry_valid = self._decode_compressed(
                x, q_residual, pos, segs, held, slots, cache
            )
        for i, s in enumerate(segs):
            mine = keys[i, kept - lengths[i] :]
            if (s.start + 1) % span == 0:
                self._write_checkpoints(s, mine, s.start - lengths[i], slots[i], cache)
            last = mine[max(0, mine.shape[0] - kept) :]
            self.held[s.seq] = _Held(s.start + 1, last, rows_from[i], rows[i])
        out = self._attend(q, keys, valid, entries, entry_valid)
        return self.rope(out, pos, inverse=True)

    def _decode_compressed(self, x, q_residual, pos, segs, held, slots, cache: LayerCache):
        """:meth:`_compressed` for :meth:`_decode`'s requests: each request's windows compressed
        (:meth:`_compress`), then the compressed entries each attends, ``[B, E, hd]`` float32, and
        which are real ``[B, E]`` -> ``(first positions kept, rows kept, entries, real)``
        (entries None while no request has one)."""
        projected = self._projections(x)
        his, rows_from, rows = [], [], []
        for i, s in enumerate(segs):
            own = [p[i : i + 1] for p in projected]
            hi, first, kept = self._compress(s, own, held[i], slots[i], cache)
            his.append(hi)
            rows_from.append(first)
            rows.append(kept)
        m, comp, most = self.ratio, self.compressor, max(his)
        if not most:
            return rows_from, rows, None, None
        device = x.device
        context = torch.nn.utils.rnn.pad_sequence(
            [sl[: hi * m] for sl, hi in zip(slots, his, strict=True)], batch_first=True
        )  # [B, most * m] slots, padded with slot 0 (masked)
        counts = torch.tensor(his, device=device)
        valid = torch.arange(most, device=device)[None, :] < counts[:, None]
        k = most if self.indexer is None else min(self.v4.index_topk, most)
        if k < most:
            keys = gather(self._part(cache, INDEX_ENTRY), context).reshape(len(his), most, -1)
            scores = self.indexer.scores(x, q_residual, keys, self.compress_rope, pos)
            chosen = scores.masked_fill(~valid, float("-inf")).topk(k, dim=-1).indices
            tokens = (chosen[..., None] * m + torch.arange(m, device=device)).flatten(1)
            entries = gather(self._part(cache, ENTRY), context.gather(1, tokens))
            entries = entries.reshape(len(his), k, comp.dim)
            return rows_from, rows, entries.float(), valid.gather(1, chosen)
        entries = gather(self._part(cache, ENTRY), context).reshape(len(his), most, comp.dim)
        return rows_from, rows, entries.float(), valid

    def _compressed(self, x, q_residual, pos, s: Segment, slots, cache: LayerCache, held):
        """Compress the windows this segment completes, writing each entry as ``ratio`` slices at
        its tokens (and, at a block's end, CSA's tail); -> ``(entries [E, hd], visible [L, E])``
        of every entry up to the segment's end or, where the indexer's picks are fewer rows than
        the context (decode), each query's own ``(entries [L, k, hd], valid [L, k])``; then the
        first position and the rows of the projections later windows still read."""
        m, comp = self.ratio, self.compressor
        hi, keep, rows = self._compress(s, self._projections(x), held, slots, cache)
        context = slots[: hi * m]
        visible = torch.arange(hi, device=x.device)[None, :] < ((pos + 1) // m)[:, None]
        if self.indexer is None or not hi:
            entries = gather(self._part(cache, ENTRY), context).reshape(hi, comp.dim)
            return entries, visible, keep, rows
        keys = gather(self._part(cache, INDEX_ENTRY), context).reshape(hi, -1)
        scores = self.indexer.scores(x, q_residual, keys, self.compress_rope, pos)
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(self.v4.index_topk, hi)
        chosen = scores.topk(k, dim=-1).indices  # [L, k]
        if x.shape[0] * k < hi:  # decode: gather each query's k entries, not the whole context
            tokens = chosen[..., None] * m + torch.arange(m, device=x.device)
            picked = gather(self._part(cache, ENTRY), slots[tokens])
            picked = picked.reshape(*chosen.shape, comp.dim)
            return picked, visible.gather(1, chosen), keep, rows
        entries = gather(self._part(cache, ENTRY), context).reshape(hi, comp.dim)
        picked = torch.zeros_like(visible)
        picked.scatter_(1, chosen, True)
        return entries, visible & picked, keep, rows

    def _projections(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The compressor's key and gate projections of ``x`` (and the indexer's, with CSA)."""
        comp = self.compressor
        projected = [comp.wkv(x), comp.wgate(x)]
        if self.indexer is not None:
            ic = self.indexer.compressor
            projected += [ic.wkv(x), ic.wgate(x)]
        return projected

    def _compress(self, s: Segment, projected, held, slots, cache: LayerCache):
        """Append ``s``'s ``projected`` rows to what ``held`` keeps, compress the windows ``s``
        completes into the cache (each entry as ``ratio`` slices at its tokens; at a block's end,
        CSA's tail) -> ``(entries up to s's end, first position kept, the rows kept)``."""
        m, end = self.ratio, s.start + s.length
        comp = self.compressor
        first = held.start
        rows = [torch.cat([old, new]) for old, new in zip(held.rows, projected, strict=True)]
        lo, hi = (s.start + m) // m - 1, end // m  # windows completing here: lo .. hi - 1
        if hi > lo:
            prior = 1 if comp.overlap and lo > 0 else 0
            span = slice((lo - prior) * m - first, hi * m - first)
            at = torch.arange(lo, hi, device=slots.device)
            tokens = slots[lo * m : hi * m]
            entries = self.compress_rope(comp.entries(rows[0][span], rows[1][span], lo), at * m)
            self._part(cache, ENTRY)[tokens] = entries.reshape(-1, comp.dim // m)
            if self.indexer is not None:
                ic = self.indexer.compressor
                keys = self.compress_rope(ic.entries(rows[2][span], rows[3][span], lo), at * m)
                self._part(cache, INDEX_ENTRY)[tokens] = keys.reshape(-1, ic.dim // m)
        if self.indexer is not None:
            self._write_tails(s, rows, first, slots, cache)
        keep = max(first, (end // m - (1 if comp.overlap else 0)) * m)
        return hi, keep, [r[keep - first :] for r in rows]

    def _tail_split(self) -> list[int]:
        m, hd, idx = self.ratio, self.head_dim, self.indexer.compressor.dim
        return [m * hd, m * hd, m * idx, m * idx]

    def _write_tails(self, s: Segment, rows, first: int, slots, cache: LayerCache) -> None:
        """For every block this segment completes: the first halves of its last window's
        projections, spread over the block's tokens' ``tail`` part."""
        m, block = self.ratio, cache.step.cache.block_size
        end = s.start + s.length
        part = self._part(cache, TAIL)
        for boundary in range((s.start // block + 1) * block, end + 1, block):
            window = slice(boundary - m - first, boundary - first)
            halves = [r[window, : r.shape[-1] // 2].reshape(-1) for r in rows]
            values = torch.cat(halves).to(part.dtype)
            padded = values.new_zeros(block * part.shape[-1])
            padded[: values.numel()] = values
            part[slots[boundary - block : boundary]] = padded.view(block, -1)

    def _write_checkpoints(self, s: Segment, keys, first: int, slots, cache: LayerCache) -> None:
        """At every block end this segment reaches, the window keys before it, spread over the
        block's tokens' ``kv`` part (``keys`` are positions ``first ..``)."""
        part, span = self._part(cache, WINDOW_KV), cache.step.cache.block_size
        end, kept = s.start + s.length, self.v4.sliding_window - 1
        for boundary in range((s.start // span + 1) * span, end + 1, span):
            values = keys[boundary - kept - first : boundary - first].reshape(-1).to(part.dtype)
            padded = values.new_zeros(span * part.shape[-1])
            padded[: values.numel()] = values
            part[slots[boundary - span : boundary]] = padded.view(span, -1)

    def _part(self, cache: LayerCache, name: str) -> torch.Tensor:
        """``[slots, width]`` view of this layer's ``name`` part (:func:`kv_layout`)."""
        return cache.part(f"{name}.{self.layer}")

    def _resume(self, seq: int, start: int, slots, cache: LayerCache) -> _Held:
        """What ``seq`` holds from before ``start``: its own from the last segment, or rebuilt at a
        block boundary — the window keys from the previous block's checkpoint, no compression
        window open but, with CSA, the previous block's tail."""
        held = self.held.get(seq)
        if held is not None and held.end == start:
            return held
        span, hd = cache.step.cache.block_size, self.head_dim
        dtype, device = self.wkv.weight.dtype, self.wkv.weight.device
        widths = []
        if self.compressor is not None:
            widths = [self.compressor.wkv.out_features] * 2
        if self.indexer is not None:
            widths += [self.indexer.compressor.wkv.out_features] * 2
        empty = [torch.zeros(0, w, dtype=dtype, device=device) for w in widths]
        if start == 0:
            return _Held(0, torch.zeros(0, hd, dtype=dtype, device=device), 0, empty)
        if start % span:
            raise RuntimeError(
                f"sequence {seq}: a DeepSeek-V4 layer resumes at block boundaries only (every {span} "
                f"tokens), not at position {start}"
            )
        kept = self.v4.sliding_window - 1
        flat = gather(self._part(cache, WINDOW_KV), slots[start - span : start]).reshape(-1)
        window = flat[: kept * hd].view(kept, hd).to(dtype)
        if self.indexer is None:
            return _Held(start, window, start, empty)
        m, block = self.ratio, cache.step.cache.block_size
        flat = gather(self._part(cache, TAIL), slots[start - block : start]).reshape(-1)
        halves = flat[: sum(self._tail_split())].split(self._tail_split())
        rows = []
        for half, width in zip(halves, widths, strict=True):
            row = torch.zeros(m, width, dtype=dtype, device=device)
            row[:, : width // 2] = half.view(m, width // 2).to(dtype)
            rows.append(row)
        return _Held(start, window, start - m, rows)

    def release(self, seq: int) -> None:
        self.held.pop(seq, None)


@dataclass
class _Held:
    """What a sequence holds outside the cache after position ``end - 1``: its last
    ``sliding_window - 1`` window keys, and its compressor projections of positions ``start ..
    end - 1`` (key and gate, and the indexer's with CSA) that later windows still read."""

    end: int
    window: torch.Tensor
    start: int
    rows: list[torch.Tensor]


class HyperConnection(nn.Module):
    """mHC: from ``hc`` residual streams, the weights that collapse them into a block's input
    (``pre``), expand its output (``post``) and mix the streams (``comb``, Sinkhorn-projected to a
    doubly stochastic matrix)."""

    def __init__(self, hidden: int, v4: V4Attention, eps: float) -> None:
        super().__init__()
        hc = v4.hc_mult
        self.hc, self.iters, self.hc_eps, self.eps = hc, v4.hc_sinkhorn_iters, v4.hc_eps, eps
        self.fn = nn.Parameter(torch.zeros((2 + hc) * hc, hc * hidden))
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor):
        """``streams [T, hc, H]`` -> ``(post [T, hc], comb [T, hc, hc], collapsed [T, H])``."""
        hc = self.hc
        flat = _head_rms(streams.flatten(1).float(), self.eps) @ self.fn.float().t()
        pre_w, post_w, comb_w = flat.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([hc, hc, hc * hc])
        scale = self.scale.float()
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = (comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc)).softmax(-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def _expand(streams: torch.Tensor, post, comb, out: torch.Tensor) -> torch.Tensor:
    """Streams after a block: ``post`` spreads its output, ``comb^T`` mixes the streams."""
    dtype = streams.dtype
    return (
        post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + comb.to(dtype).transpose(-1, -2) @ streams
    )


class Router(nn.Module):
    """V4's gate: top-k of ``score(logits) + bias`` (or, with a ``tid2eid`` table, the token's
    fixed experts), weights the chosen scores normalised and scaled."""

    def __init__(self, block: MoEConfig, hashed: bool, vocab_size: int) -> None:
        super().__init__()
        self.block = block
        self.weight = nn.Parameter(torch.zeros(block.num_routed_experts, block.hidden_size))
        self.register_buffer("bias", torch.zeros(block.num_routed_experts))
        self.tid2eid = (
            nn.Buffer(torch.zeros(vocab_size, block.experts_per_token, dtype=torch.int64))
            if hashed
            else None
        )

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor):
        """``x [T, H]``, ``token_ids [T]`` -> ``(weights [T, k] float32, indices [T, k])``."""
        scores = expert_scores(x.float() @ self.weight.float().t(), self.block.scoring)
        if self.tid2eid is not None:
            indices = self.tid2eid[token_ids]
        else:
            k = self.block.experts_per_token
            indices = torch.topk(scores + self.bias.float(), k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.block.routed_scaling_factor, indices


class V4Layer(nn.Module):
    """Attention and MoE, each between mHC collapse and expand."""

    def __init__(self, config: ModelConfig, layer: int, moe: ExpertParallelMoE, ropes) -> None:
        super().__init__()
        block, v4 = config.block, config.v4
        self.attn_norm = RMSNorm(block.hidden_size, block.rms_norm_eps)
        self.attn = V4AttentionLayer(block, v4, layer, ropes)
        self.ffn_norm = RMSNorm(block.hidden_size, block.rms_norm_eps)
        self.hc_attn = HyperConnection(block.hidden_size, v4, block.rms_norm_eps)
        self.hc_ffn = HyperConnection(block.hidden_size, v4, block.rms_norm_eps)
        self.gate = moe.gate
        self.moe = moe

    def forward(self, streams, token_ids, segments, cache: LayerCache) -> torch.Tensor:
        post, comb, collapsed = self.hc_attn(streams)
        streams = _expand(
            streams, post, comb, self.attn(self.attn_norm(collapsed), segments, cache)
        )
        post, comb, collapsed = self.hc_ffn(streams)
        xn = self.ffn_norm(collapsed)
        weights, indices = self.gate(xn, token_ids)
        out = self.moe.routed_output(xn, weights, indices) + self.moe.shared_output(xn)
        return _expand(streams, post, comb, out)


class HyperHead(nn.Module):
    """Collapses the streams after the last layer (sigmoid weights, no mixing)."""

    def __init__(self, hidden: int, v4: V4Attention, eps: float) -> None:
        super().__init__()
        self.hc_fn = nn.Parameter(torch.zeros(v4.hc_mult, v4.hc_mult * hidden))
        self.hc_base = nn.Parameter(torch.zeros(v4.hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))
        self.hc_eps, self.eps = v4.hc_eps, eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = _head_rms(streams.flatten(1).float(), self.eps) @ self.hc_fn.float().t()
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class DeepseekV4(nn.Module):
    """This rank's DeepSeek-V4: every dense weight, and the routed experts of its EP slots."""

    def __init__(self, config: ModelConfig, plan: Plan, comm: Communicator, experts) -> None:
        super().__init__()
        block, v4 = config.block, config.v4
        self.config, self.plan = config, plan
        ropes = {
            "main": Rope(v4.rope_dim, v4.rope_theta, None),
            "compress": Rope(v4.rope_dim, v4.compress_rope_theta, v4.yarn),
        }
        self.embed = nn.Embedding(config.vocab_size, block.hidden_size)
        self.layers = nn.ModuleList(
            V4Layer(config, i, experts[i], ropes) for i in range(config.num_layers)
        )
        self.moe = experts
        self.decoder = ExpertParallelDecoder.from_layers(self.layers, self.moe, comm)
        self.hc_head = HyperHead(block.hidden_size, v4, block.rms_norm_eps)
        self.norm = RMSNorm(block.hidden_size, block.rms_norm_eps)
        self.head = Linear(block.hidden_size, config.vocab_size)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, segments: list[Segment], cache: StepCache, overlap: str
    ) -> torch.Tensor:
        """``input_ids [T]`` laid out as ``segments`` -> final hidden states ``[T, H]`` (normed).
        ``overlap`` is accepted for the engine's interface; V4 layers run one after another."""
        x = self.embed(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.v4.hc_mult, -1).contiguous()
        rows = cache.layer(0)  # one row of every layer's parts (:func:`kv_layout`)
        for layer in self.layers:
            streams = layer(streams, input_ids, segments, rows)
        return self.norm(self.hc_head(streams))

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def release(self, seq: int) -> None:
        """Forget what ``seq`` holds outside the cache (it finished or was preempted)."""
        for layer in self.layers:
            layer.attn.release(seq)


# ---------------------------------------------------------------------------------------- loading
def _resolve(reader: CheckpointReader, name: str) -> str:
    """``name`` in transformers' layout, or DeepSeek's own name of the same tensor."""
    if name in reader:
        return name
    native = name.removeprefix("model.")
    native = {
        "embed_tokens.weight": "embed.weight",
        "hc_head.hc_fn": "hc_head_fn",
        "hc_head.hc_base": "hc_head_base",
        "hc_head.hc_scale": "hc_head_scale",
    }.get(native, native)
    return native if native in reader else name


def _load(module: nn.Module, reader: CheckpointReader, prefix: str, skip=()) -> None:
    """Every parameter and buffer of ``module`` from ``prefix + its name`` (mHC weights are
    ``hc_attn_fn``, not ``hc_attn.fn``), in the dtype it has."""
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    for name, target in tensors.items():
        if name.split(".")[0] in skip:
            continue
        stored = name.replace("hc_attn.", "hc_attn_").replace("hc_ffn.", "hc_ffn_")
        key = _resolve(reader, prefix + stored)
        with torch.no_grad():
            value = reader.get(key, tuple(target.shape), target.dtype)
            target.copy_(value)


def _experts(reader, config: ModelConfig, plan: Plan, layer: int, comm, dtype):
    block, prefix = config.block, f"model.layers.{layer}.ffn."
    limit = block.swiglu_limit
    router = Router(block, config.v4.hash_layers[layer], config.vocab_size)
    if router.tid2eid is not None and _resolve(reader, prefix + "gate.tid2eid") not in reader:
        raise CheckpointError(
            f"{reader.model_dir}: layer {layer} routes by hash (mlp_layer_types / "
            f"num_hash_layers) but tensor {prefix}gate.tid2eid is missing"
        )
    _load(router, reader, prefix + "gate.", skip=() if router.tid2eid is None else ("bias",))

    def expert(name: str, size: int) -> Expert:
        module = Expert(block.hidden_size, size, limit).to(dtype)
        _load(module, reader, prefix + name)
        return module

    shared = None
    if block.num_shared_experts:
        shared = expert("shared_experts.", block.num_shared_experts * block.moe_intermediate_size)
    experts = {
        e: expert(f"experts.{e}.", block.moe_intermediate_size)
        for e in rank_experts(plan, layer, comm.rank)
    }
    return ExpertParallelMoE.from_experts(block, router, shared, experts, plan, layer, comm)


def load(
    reader: CheckpointReader,
    config: ModelConfig,
    plan: Plan,
    comm: Communicator,
    dtype: torch.dtype = torch.float32,
    keep_fp8: bool = False,
) -> DeepseekV4:
    """Build this rank's model from ``reader`` (FP8 weights dequantised to ``dtype``)."""
    if plan.num_layers != config.num_layers:
        raise ValueError(f"plan has {plan.num_layers} layers, the model has {config.num_layers}")
    experts = nn.ModuleList(
        _experts(reader, config, plan, i, comm, dtype) for i in range(config.num_layers)
    )
    model = DeepseekV4(config, plan, comm, experts)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        # sinks, position biases, mHC and router weights stay float32, as DeepSeek keeps them
        kept = any(part in name for part in _FLOAT32_PARTS) or ".gate." in name
        if tensor.is_floating_point() and not kept:
            tensor.data = tensor.data.to(dtype)
    for i, layer in enumerate(model.layers):
        _load(layer, reader, f"model.layers.{i}.", skip=("gate", "moe"))
    _load(model.embed, reader, "model.embed_tokens.")
    _load(model.hc_head, reader, "model.hc_head.")
    _load(model.norm, reader, "model.norm.")
    _load(model.head, reader, "head.")
    return model


_FLOAT32_PARTS = ("attn_sink", ".ape", "hc_attn", "hc_ffn", "hc_head")


__all__ = ["MODEL_TYPE", "DeepseekV4", "V4Attention", "kv_layout", "load", "parse_config"]
