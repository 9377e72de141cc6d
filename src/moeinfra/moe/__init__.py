"""Expert-parallel DeepSeek-V3 MoE on ``torch.distributed`` (gloo on CPU, NCCL on GPU).

* :class:`MoEConfig`, :func:`deepseek_v3`, :func:`tiny`, :func:`small` — the model's knobs.
* :class:`Gate` / :func:`route` — sigmoid scores, selection-only bias, group-limited top-k.
* :class:`MoE` — the single-process reference (SwiGLU routed experts + shared expert).
* :class:`Decoder` — small DeepSeek-V3 decoder (MLA attention + MoE) for the overlap schedules.
* :class:`ExpertParallelMoE` — one rank's part of an MoE layer placed by an EPLB plan: dispatch and
  combine with ``all_to_all_single``, redundant experts, load recording, ``apply_plan`` migration.
* :class:`ExpertParallelDecoder` — the decoder with EP MoE layers, run with overlap ``none``,
  ``prefill`` (dual micro-batch) or ``decode`` (5-stage pipeline); :func:`schedule` gives the order.
* :class:`Recorder`, :func:`write_chrome_trace` — compute/communication timelines per rank.
* :func:`run` / :class:`RunConfig` — ``moeinfra moe run``: N local gloo ranks end to end.

Needs torch (``pip install moeinfra[torch]``).
"""

from moeinfra.moe.block import Decoder, DecoderBlock, build_decoder
from moeinfra.moe.comm import Communicator, Pending
from moeinfra.moe.config import MoEConfig, deepseek_v3, preset, small, tiny
from moeinfra.moe.expert_parallel import ExpertParallelMoE, load_matrix
from moeinfra.moe.gate import Gate, route
from moeinfra.moe.launch import launch
from moeinfra.moe.layers import MoE, build_moe
from moeinfra.moe.mla import MLA, Segment
from moeinfra.moe.run import RunConfig, run
from moeinfra.moe.runtime import ExpertParallelDecoder, split_micro_batches
from moeinfra.moe.schedules import MODES, Op, schedule
from moeinfra.moe.timeline import Recorder, chrome_trace, overlap, write_chrome_trace

__all__ = [
    "MLA",
    "MODES",
    "Communicator",
    "Decoder",
    "DecoderBlock",
    "ExpertParallelDecoder",
    "ExpertParallelMoE",
    "Gate",
    "MoE",
    "MoEConfig",
    "Op",
    "Pending",
    "Recorder",
    "RunConfig",
    "Segment",
    "build_decoder",
    "build_moe",
    "chrome_trace",
    "deepseek_v3",
    "launch",
    "load_matrix",
    "overlap",
    "preset",
    "route",
    "run",
    "schedule",
    "split_micro_batches",
    "small",
    "tiny",
    "write_chrome_trace",
]
