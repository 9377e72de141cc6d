"""The on-disk KV cache of a replayed trace: which prompt blocks are already stored.

Prefill writes every block of a prompt; decode writes the blocks its output fills. A trace names
prompt blocks by hash (Mooncake's ``hash_ids``, one per ``block_tokens`` tokens) but not output
blocks, so the output a request wrote is recognised when a later prompt extends it: a prompt that
repeats all full blocks of an earlier request's prompt continues with that request's output (a
follow-up turn), whose full blocks are then cache hits too. The store never evicts (DeepSeek's
cache sits on a distributed file system).
"""

from __future__ import annotations


class PrefixCache:
    """Blocks written so far, in the order requests are fed to :meth:`serve`."""

    def __init__(self, block_tokens: int = 512) -> None:
        self.block_tokens = block_tokens
        self._stored: set = set()
        # last full prompt block of a request -> (its full prompt blocks, full blocks its output adds)
        self._continued: dict = {}

    def serve(self, hash_ids: list, input_tokens: int, output_tokens: int) -> int:
        """Cached prefix (tokens) of this prompt; then store what its prefill and decode write."""
        hits = 0
        while hits < len(hash_ids) and hash_ids[hits] in self._stored:
            hits += 1
        if hits:
            full, written = self._continued.get(hash_ids[hits - 1], (0, 0))
            if full == hits:
                hits = min(hits + written, len(hash_ids))
        self._stored.update(hash_ids)
        full = min(input_tokens // self.block_tokens, len(hash_ids))
        if full:
            added = (input_tokens + output_tokens) // self.block_tokens - full
            self._continued[hash_ids[full - 1]] = (full, added)
        return hits * self.block_tokens
