"""Every message that crosses a server socket, as ``msgspec`` structs encoded in MessagePack.

A socket is a door: pickle would run whatever comes through it, so nothing here is pickled. Each
direction has one tagged union (:data:`ToRank`, :data:`ToRouter`) and one decoder; a frame that
does not decode into it (truncated, foreign, of an unknown kind, with a field of the wrong type
or a value :class:`~moeinfra.engine.params.SamplingParams` refuses) raises
:class:`BadFrame`, and the receiver drops it, counts it and goes on. KV blocks stay raw frames
behind a :class:`KVHeader` (:mod:`moeinfra.server.kv_transfer`).
"""

from __future__ import annotations

import msgspec

from moeinfra.engine.outputs import StepOutput
from moeinfra.engine.params import SamplingParams


class BadFrame(ValueError):
    """A frame that is not a message of the expected kind (what was wrong, in one line)."""


# ---------------------------------------------------------------- API server -> unit rank
class Add(msgspec.Struct, tag="add"):
    """Run a request: prefill then decode here, or (``handoff``: a decode rank's KV address)
    prefill here and hand the KV off after the first token."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    handoff: str | None = None


class Abort(msgspec.Struct, tag="abort"):
    request_id: str


class Welcome(msgspec.Struct, tag="welcome"):
    """The API server took the rank's hello."""


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the unit (``reason``: why the API server refused it; empty for a normal stop)."""

    reason: str = ""


class Rejoin(msgspec.Struct, tag="rejoin"):
    """The API server does not know the rank (it restarted, or it gave the rank's unit up after
    a silence): end every request the rank holds (they belonged to what the server forgot) and
    say hello again."""


class Release(msgspec.Struct, tag="release"):
    """The decode rank took (or will never take) a request's hand-off: a prefill rank that lent
    its blocks to a connector reading them remotely (Mooncake) frees them."""

    request_id: str


ToRank = Add | Abort | Welcome | Shutdown | Rejoin | Release


# ---------------------------------------------------------------- unit rank -> API server
class Hello(msgspec.Struct, tag="hello"):
    """A rank joins: who it is, where it takes KV (decode ranks), and its engine's shape.

    ``incarnation`` names one start of the unit: its ranks agree on it when they start, and a
    restart (of the process, or of every rank by the elastic agent) draws a new one, so the
    API server tells a unit that started again from a rank of the old start."""

    unit: str
    rank: int
    ranks: int
    role: str
    model: str  # digest of the checkpoint's config.json
    max_num_seqs: int
    kv_address: str | None = None
    pid: int = 0
    host: str = ""
    num_kv_blocks: int = 0
    block_size: int = 0
    max_num_batched_tokens: int = 0
    redundant_experts: int = 0
    num_speculative_tokens: int = 0
    dtype: str = ""
    device: str = ""
    incarnation: str = ""
    kv_connector: str = ""  # how its KV blocks move (prefill and decode ranks)


class Outputs(msgspec.Struct, tag="out"):
    outputs: list[StepOutput]


#: One engine step of a rank: (step, prefill tokens, decode tokens, attended keys, sampled rows,
#: seconds, ended at (Unix time)).
StepRow = tuple[int, int, int, int, int, float, float]


class State(msgspec.Struct, tag="state"):
    """A rank's periodic report. Counters (``*_tokens``, ``*_blocks``, ``*_bytes``, ``spec_*``,
    ``dropped_frames``, ``preemptions``) are totals since the rank started; ``steps`` are the steps since the last
    report; ``expert_gpu_load`` is ``[moe layers, ranks]`` tokens over the engine's EPLB window."""

    waiting: int = 0
    running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    disk_hit_tokens: int = 0
    disk_written_blocks: int = 0
    expert_gpu_load: list[list[float]] | None = None
    rebalances: int = 0
    kv_sent_bytes: int = 0
    kv_received_bytes: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    dropped_frames: int = 0
    preemptions: int = 0
    steps: list[StepRow] = []


class Received(msgspec.Struct, tag="received"):
    """A decode rank took a request's KV hand-off (the hand-off is complete)."""

    request_id: str


class Failed(msgspec.Struct, tag="failed"):
    """A request the rank could not take (a hand-off that failed verification)."""

    request_id: str
    message: str


class Bye(msgspec.Struct, tag="bye"):
    """The rank is stopping (on its own when the API server did not ask it to)."""

    rank: int


ToRouter = Hello | Outputs | State | Received | Failed | Bye


# ---------------------------------------------------------------- prefill rank -> decode rank
class KVHeader(msgspec.Struct):
    """The first frame of a KV hand-off: the request, its first tokens and drafts, and the
    layout and CRC-32 of each block (the frames that follow, or where to read them)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    num_cached_tokens: int
    drafts: list[int]
    shape: tuple[int, int, int]  # [layers, prompt tokens, values]
    dtype: str
    block_size: int
    crc32: list[int]
    # blocks the decode rank reads itself (Mooncake): the prefill rank's transfer-engine session
    # (host:port) and the address of its blocks there, back to back; empty: the frames that follow
    source: str = ""
    address: int = 0


_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode


class Decoder:
    """Decodes frames into one message type, raising :class:`BadFrame` for anything else."""

    def __init__(self, kind) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind)

    def __call__(self, frame) -> object:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise BadFrame(str(err)) from None


decode_to_rank = Decoder(ToRank)
decode_to_router = Decoder(ToRouter)
decode_kv_header = Decoder(KVHeader)
