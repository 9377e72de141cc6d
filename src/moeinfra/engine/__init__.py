"""Inference engine for DeepSeek-V3-architecture checkpoints (work in progress)."""
