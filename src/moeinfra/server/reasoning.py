"""Thinking split from the answer (``serve up --reasoning-parser``), as vLLM's parsers of the same
names split it:

* ``deepseek_r1``: the text up to ``</think>`` is reasoning (after a ``<think>`` the output may
  open with; DeepSeek-R1's template opens it in the prompt), the rest is the answer; with no
  ``</think>`` everything so far is reasoning;
* ``deepseek_v3`` (V3.1, V3.2): the same when the request's ``chat_template_kwargs`` turn thinking
  on (``thinking`` or ``enable_thinking``), else everything is the answer (their templates close
  the thinking in the prompt).
"""

from __future__ import annotations

from moeinfra.server.tool_parsers import held_back

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    """``split(text, final)`` -> (reasoning or None, answer text)."""

    name = ""

    def __init__(self, template_kwargs: dict | None = None) -> None:
        self.template_kwargs = template_kwargs or {}

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        raise NotImplementedError

    def thinks(self) -> bool:
        """Whether the output opens with thinking (a grammar then starts after it)."""
        return True


class DeepSeekR1Reasoning(ReasoningParser):
    name = "deepseek_r1"

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        at = text.find(THINK_START)
        if at >= 0:
            text = text[at + len(THINK_START) :]
        elif not final and held_back(text, THINK_START) == len(text):
            return None, ""  # may still become <think>
        if THINK_END in text:
            reasoning, answer = text.split(THINK_END, 1)
            return reasoning, answer
        keep = len(text) - (0 if final else held_back(text, THINK_END))
        return text[:keep], ""


class DeepSeekV3Reasoning(ReasoningParser):
    name = "deepseek_v3"

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        if self.thinks():
            return DeepSeekR1Reasoning().split(text, final)
        return None, text

    def thinks(self) -> bool:
        return bool(
            self.template_kwargs.get("thinking") or self.template_kwargs.get("enable_thinking")
        )


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1Reasoning, DeepSeekV3Reasoning)
}
