"""Drafting with DeepSeek's MTP layer: after each step, the layer runs over every position the
step computed and proposes ``num_speculative_tokens`` tokens for every request that got a new one;
the next step verifies them (:mod:`moeinfra.engine.speculative`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moeinfra.engine.kv_cache import StepCache
from moeinfra.engine.registry import require_mtp
from moeinfra.engine.sequence import Sequence
from moeinfra.moe.mla import Segment

if TYPE_CHECKING:
    from moeinfra.engine.checkpoint import CheckpointReader
    from moeinfra.engine.core import EngineCore


class MtpDrafter:
    """The checkpoint's MTP layer as ``core``'s draft model (its experts placed evenly)."""

    def __init__(
        self, core: EngineCore, reader: CheckpointReader, dtype: torch.dtype, keep_fp8: bool
    ) -> None:
        source = str(reader.model_dir / "config.json")
        require_mtp(core.arch, core.model_config, source, "num_speculative_tokens")
        mtp = core.arch.load_mtp(
            reader, core.model_config, core._initial_plan(1), core.comm, dtype, keep_fp8
        )
        self.core, self.mtp = core, mtp.to(core.device).eval()

    def draft(
        self, scheduled, starts, hidden: torch.Tensor, step_cache: StepCache, sampled: set[int]
    ) -> None:
        """Run the MTP layer over every position this step computed (the target's hidden state
        there and the token after it), then draft ``num_speculative_tokens`` tokens for every
        request that got a new token (``sampled``: their sequence ids). Collective: the same
        number of MTP passes on every rank."""
        core = self.core
        rows, next_ids, segments, drafting = [], [], [], []
        for c, first in zip(scheduled, starts, strict=False):
            seq = c.seq
            count = min(c.start + c.length, seq.num_computed) - c.start
            if count <= 0:
                continue
            # a request that just finished still gets its MTP rows: its full blocks are in the
            # prefix cache already, and no block is handed out again before this pass
            rows.extend(range(first, first + count))
            next_ids.extend(seq.token_ids[c.start + 1 : c.start + count + 1])
            segments.append(Segment(seq.seq_id, c.start, count))
            if seq.seq_id in sampled and not seq.finished:
                drafting.append((seq, len(rows) - 1))
        mtp_layer = core.cache.layout.num_layers - 1
        ids = torch.tensor(next_ids, dtype=torch.int64, device=core.device)
        out = self.mtp(hidden[rows], ids, segments, step_cache.layer(mtp_layer))
        last = out[[row for _, row in drafting]]
        seqs = [seq for seq, _ in drafting]
        tokens = self._tokens(last)
        for seq, token in zip(seqs, tokens.tolist(), strict=True):
            seq.drafts = [token]
        for j in range(1, core.num_speculative_tokens):
            # draft j + 1 runs the layer at position num_computed + j - 1, on its own last output
            keep = [
                i
                for i, seq in enumerate(seqs)
                if core.blocks.ensure_slots(seq.seq_id, seq.num_computed + j)
            ]
            seqs, last, tokens = [seqs[i] for i in keep], last[keep], tokens[keep]
            cache = StepCache(core.cache, {s.seq_id: core._slots(s) for s in seqs})
            segments = [Segment(s.seq_id, s.num_computed + j - 1, 1) for s in seqs]
            last = self.mtp(last, tokens, segments, cache.layer(mtp_layer))
            tokens = self._tokens(last)
            for seq, token in zip(seqs, tokens.tolist(), strict=True):
                seq.drafts.append(token)
        for seq, _ in drafting:
            # a request with a grammar takes no drafts (each would need the grammar's mask)
            del seq.drafts[0 if seq.params.grammar is not None else self._room(seq) :]

    def _tokens(self, last: torch.Tensor) -> torch.Tensor:
        """The MTP layer's greedy draft after each of its outputs ``last [N, H]``; on the CPU in
        parts of about ``LOGITS_PART_BYTES`` of logits, as the engine samples."""
        if last.device.type != "cpu":
            return self.mtp.logits(last).argmax(dim=-1)
        parts = last.split(self.core._logits_rows_per_part()) or (last,)
        return torch.cat([self.mtp.logits(part).argmax(dim=-1) for part in parts])

    def _room(self, seq: Sequence) -> int:
        """Drafts worth verifying: the next step emits them and one more token, within
        ``max_tokens`` and the model's context."""
        room = self.core.model_config.max_position_embeddings - seq.num_tokens
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_ids) - 1)
        return max(0, room)
