"""The on-disk KV cache of a replayed trace: which prompt tokens are already stored.

Prefill writes every token of a prompt; decode writes the tokens its answer adds. A trace names
prompt blocks by hash (Mooncake's ``hash_ids``, one per ``block_tokens`` tokens, the last one
possibly partial) but not answer blocks, so the answer a request wrote is recognised when a later
prompt extends it. The store never evicts (DeepSeek's cache sits on a distributed file system).

Crediting rule (docs/serving-model.md, "Prefix-cache hits of a replayed trace"), per request in
arrival order:

1. **Prompt blocks.** The longest run of this prompt's leading hash ids that earlier prompts
   hold. A block counts the tokens an earlier prompt wrote in it: ``block_tokens`` where it was a
   full block, the earlier prompt's tail where it only ended one (a partial last block; the run
   stops there, since what follows in it differs or is unknown). At most this prompt's own tokens
   in the block.
2. **Answer blocks.** When the run covers exactly the full blocks of an earlier prompt and this
   prompt is long enough to hold what that request's decode completed after them (its prompt's
   tail and its answer, ``(input + output) // block_tokens - input // block_tokens`` whole blocks),
   those blocks count too: the conversation's next turn. Each answer is credited once, to the
   first prompt that holds it; a later request with the same prompt blocks (a retry) replaces
   it with its own. A trace cannot tell a next turn from another conversation that
   repeats the same prompt blocks, so this is an upper bound on what a real follow-up reuses.

So a request's hits never exceed ``block_tokens`` x (its leading hash ids found in earlier
prompts) plus the answer blocks of one earlier request, and each answer is counted once: over a
trace, the hits are at most an unbounded cache keyed by the trace's own block hashes plus every
answer's completed blocks (tests/serving/test_workload.py checks it against a brute-force count).
Hash ids past a prompt's last token describe none of it and are ignored.
"""

from __future__ import annotations


class PrefixCache:
    """Tokens written so far, in the order requests are fed to :meth:`serve`."""

    def __init__(self, block_tokens: int = 512) -> None:
        self.block_tokens = block_tokens
        self._written: dict = {}  # block hash -> tokens of it an earlier prompt wrote (<= block)
        # an earlier prompt's full blocks -> whole blocks its decode completed after them
        self._continued: dict[tuple, int] = {}

    def serve(self, hash_ids: list, input_tokens: int, output_tokens: int) -> int:
        """Cached prefix (tokens) of this prompt by the rule of the module docstring (it may
        equal ``input_tokens``: the caller keeps one token to compute); then store what its
        prefill and decode write."""
        b = self.block_tokens
        hash_ids = hash_ids[: -(-input_tokens // b)]  # ids past the prompt describe none of it
        hits = run = 0
        for k, block in enumerate(hash_ids):
            stored = self._written.get(block, 0)
            if not stored:
                break
            hits += min(stored, input_tokens - k * b)
            if stored < b:  # an earlier prompt's last, partial block: the prefix ends in it
                break
            run = k + 1
        if run and hits == run * b:
            written = self._continued.get(tuple(hash_ids[:run]), 0)
            if written and input_tokens >= (run + written) * b:
                del self._continued[tuple(hash_ids[:run])]
                hits += written * b
        full = min(input_tokens // b, len(hash_ids))
        for block in hash_ids[:full]:
            self._written[block] = b
        if len(hash_ids) > full:  # the partial last block: its tail, unless a prompt filled it
            tail = input_tokens - full * b
            last = hash_ids[full]
            self._written[last] = max(self._written.get(last, 0), tail)
        if full and full == input_tokens // b:  # the ids cover every full block of the prompt
            # the latest answer to these blocks is the one a next turn holds (a retry's)
            added = (input_tokens + output_tokens) // b - full
            if added:
                self._continued[tuple(hash_ids[:full])] = added
            else:
                self._continued.pop(tuple(hash_ids[:full]), None)
        return hits
