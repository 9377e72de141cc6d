"""DeepSeek Sparse Attention's lightning-indexer kernels, the same in DeepSeek-V3.2 and in
DeepSeek-V4's CSA layers: which cached keys a prefill micro-batch reads, the logits of every query
against every index key and the top-k over them. Each architecture adds its own projections."""

from __future__ import annotations

import numpy as np


class IndexerKernels:
    """The indexer's kernel times for a unit's ``model`` on its ``hw`` at its ``eff``, its
    logits a GEMM of :class:`~moeinfra.serving.perfmodel.roofline.Roofline` (both bases of
    :class:`~moeinfra.serving.perfmodel.step.PerfModel`, which sets them)."""

    @staticmethod
    def prefill_key_tokens(tokens, context, cached_per_token=0.0):
        """Earlier tokens whose cached keys a prefill micro-batch of ``tokens`` query tokens at
        ``context`` keys each (the mean) reads, each once (broadcasts): a chunk's queries score
        against the same keys, which the kernels take a block at a time for a tile of queries
        (DeepGEMM's MQA logits; vLLM gathers a prefill chunk's index keys once for all its
        queries). At least the tokens themselves with their cache hits
        (``tokens x (1 + cached_per_token)``: prompts whole in the micro-batch) and at least one
        request's context, ``context + tokens / 2`` (a chunk of a longer prompt reads the prefix
        before it: its queries' mean context is the prefix plus half the chunk)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        return np.maximum(tokens * (1.0 + cached_per_token), context + tokens / 2.0)

    def _index_logits_work(self, queries, keys, keys_read, key_bytes):
        """(FLOPs, bytes) of the indexer's logits for ``queries`` queries each scoring ``keys``
        index keys: ``2 x heads x dim`` per query and key; ``keys_read`` index keys of
        ``key_bytes`` read from the cache (prefill: each once, :meth:`prefill_key_tokens`;
        decode: each request's own) and one float32 logit written per query and key."""
        m = self.model
        flops = 2 * m.index_n_heads * m.index_head_dim * queries * keys
        return flops, keys_read * key_bytes + 4 * queries * keys

    def _index_scores(self, queries, keys, keys_read, key_bytes, sm_fraction: float = 1.0):
        """Seconds of the indexer's logits (DeepGEMM's MQA-logits kernels, at the FP8 GEMM rate,
        x ``gemm_time``; :meth:`_index_logits_work`) and of the top-k, reading the logits once
        (HBM-bound); V3.2's and V4's CSA indexers alike."""
        hw, eff = self.hw, self.eff
        flops, bytes_moved = self._index_logits_work(queries, keys, keys_read, key_bytes)
        top_k = 4 * queries * keys / (hw.hbm_tb_per_s * 1e12 * eff.memory)
        return self._gemm(flops, bytes_moved, sm_fraction) + top_k
