"""Inference engine for DeepSeek-V3-architecture checkpoints, in vLLM's shape.

* :class:`LLM` / :class:`SamplingParams` — ``LLM(model=PATH, ranks=R).generate(prompts, params)``.
* :class:`EngineCore` / :class:`EngineConfig` — one rank: scheduler, paged MLA KV cache, model part.
* :mod:`.registry` — architectures by ``config.json``'s ``model_type`` (``deepseek_v3``).
* :func:`init_tiny` / :func:`default_model` — the built-in tiny checkpoint.
* :class:`BlockManager` / :func:`block_hashes` — KV blocks, prefix sharing, reference counts.

Needs torch, safetensors, tokenizers and jinja2 (``pip install moeinfra[engine]``).
"""

from typing import TYPE_CHECKING

from moeinfra.engine.config import EngineConfig
from moeinfra.lazy import lazy_attributes

if TYPE_CHECKING:
    from moeinfra.engine.core import EngineCore
    from moeinfra.engine.kv_blocks import BlockManager, block_hashes
    from moeinfra.engine.llm import LLM
    from moeinfra.engine.outputs import CompletionOutput, RequestOutput, StepOutput
    from moeinfra.engine.params import SamplingParams
    from moeinfra.engine.tiny import default_model, init_tiny
    from moeinfra.engine.tokenizer import Tokenizer

# Imported on first use, so that `moeinfra.engine.config` (and a command checking its options)
# does not pull in torch.
_LAZY = {
    "EngineCore": "core",
    "StepOutput": "outputs",
    "BlockManager": "kv_blocks",
    "block_hashes": "kv_blocks",
    "LLM": "llm",
    "CompletionOutput": "outputs",
    "RequestOutput": "outputs",
    "SamplingParams": "params",
    "default_model": "tiny",
    "init_tiny": "tiny",
    "Tokenizer": "tokenizer",
}

__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "LLM",
    "BlockManager",
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "RequestOutput",
    "SamplingParams",
    "StepOutput",
    "Tokenizer",
    "block_hashes",
    "default_model",
    "init_tiny",
]
