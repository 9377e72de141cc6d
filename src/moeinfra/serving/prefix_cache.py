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
        # an earlier request's full prompt blocks -> full blocks its output adds after them
        self._continued: dict[tuple, int] = {}

    def serve(self, hash_ids: list, input_tokens: int, output_tokens: int) -> int:
        """Cached prefix (tokens) of this prompt; then store what its prefill and decode write.

        An earlier answer counts only for a prompt that repeats that request's whole prompt (all
        its full blocks) and is long enough to hold the answer after it, and only once: the
        conversation's next turn. A first block every conversation shares (a system prompt)
        credits no answer to the prompts that merely start with it."""
        hits = 0
        while hits < len(hash_ids) and hash_ids[hits] in self._stored:
            hits += 1
        if hits:
            key = tuple(hash_ids[:hits])
            written = self._continued.get(key, 0)
            if written and input_tokens >= (hits + written) * self.block_tokens:
                del self._continued[key]
                hits = min(hits + written, len(hash_ids))
        self._stored.update(hash_ids)
        full = min(input_tokens // self.block_tokens, len(hash_ids))
        if full:
            added = (input_tokens + output_tokens) // self.block_tokens - full
            if added:
                self._continued[tuple(hash_ids[:full])] = added
        return hits * self.block_tokens
