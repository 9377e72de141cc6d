"""Classify GPU ops into compute / communication / memory with an ordered, anchored rule list.

A rule is a regular expression matched **at the start** of the op's *key*: its name with a leading
return type (``void ``) removed, so ``dpsk::ep::internode::dispatch<...>(...)`` has the key
``dpsk::ep::internode::dispatch<...>(...)``. Anchoring at the start means a namespace rule such as
``dpsk::ep::`` matches the kernel's own namespace and never a template argument
(``cutlass::device_kernel<dpsk::ep::...>``) or a longer namespace that merely contains the text
(``xdpsk::ep::``). Rules are tried in order; the first match wins; an op no rule matches falls
back by kind: kernels are compute, memcpy/memset are memory. Users add rules in front
(``--comm-pattern``); write ``.*foo`` to match ``foo`` anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from moeinfra.errors import InputError
from moeinfra.trace.model import KERNEL, GpuOps

COMPUTE, COMM, MEMORY = 0, 1, 2
CLASS_NAMES = ("compute", "communication", "memory")
_CLASS_CODES = {"compute": COMPUTE, "communication": COMM, "comm": COMM, "memory": MEMORY}

_RETURN_TYPE = re.compile(r"^\s*(?:(?:void|static|__global__)\s+)+")
_EP_NS = r"(?:deep_ep|dpsk::ep)::(?:\w+::)*"


@dataclass(frozen=True)
class Rule:
    """``pattern`` (regex, matched at the start of the op key) -> ``op_class``; ``label`` names the library."""

    pattern: str
    op_class: str
    label: str

    def __post_init__(self) -> None:
        if self.op_class not in _CLASS_CODES:
            raise InputError(
                f"op_class={self.op_class!r} is not allowed; use 'compute', 'communication' or 'memory'"
            )
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise InputError(
                f"pattern={self.pattern!r} is not a valid regular expression: {exc}"
            ) from None


# Order matters: the layout kernel lives in the DeepEP namespace but only computes the routing layout.
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(_EP_NS + r"get_dispatch_layout\b", "compute", "DeepEP layout"),
    Rule(
        _EP_NS
        + r"(?:\w*dispatch\w*|\w*combine\w*|\w*notify\w*|clean_low_latency_buffer|barrier\w*|\w*send\w*|\w*recv\w*)(?:[<(\s]|$)",
        "communication",
        "DeepEP",
    ),
    Rule(r"(?:nccl|rccl)\w*", "communication", "NCCL/RCCL"),
    Rule(r"(?i:hccl|hcom)\w*", "communication", "HCCL"),
    Rule(r"gloo:", "communication", "gloo"),
    Rule(r"Memcpy PtoP\b", "communication", "peer-to-peer memcpy"),
    Rule(r"(?:vllm::)?cross_device_reduce\w*", "communication", "custom all-reduce"),
)


def op_key(name: str) -> str:
    """The text rules are matched against: the name without a leading return type."""
    return _RETURN_TYPE.sub("", name, count=1)


def comm_rules(patterns: Iterable[str], label: str = "user") -> list[Rule]:
    """User communication rules (``--comm-pattern``), to put in front of :data:`DEFAULT_RULES`."""
    return [Rule(p, "communication", label) for p in patterns]


class Classifier:
    """Compiled rule list; classifies each distinct op name once."""

    def __init__(self, rules: Sequence[Rule] = DEFAULT_RULES) -> None:
        self.rules = tuple(rules)
        self._compiled = [
            (re.compile(r.pattern), _CLASS_CODES[r.op_class], i) for i, r in enumerate(self.rules)
        ]

    def match(self, name: str) -> int | None:
        """Index of the first rule matching ``name``, or None."""
        key = op_key(name)
        for pattern, _, index in self._compiled:
            if pattern.match(key):
                return index
        return None

    def classify_name(self, name: str, kind: int = KERNEL) -> int:
        """Class code (COMPUTE / COMM / MEMORY) of one op name of the given kind."""
        index = self.match(name)
        if index is not None:
            return self._compiled[index][1]
        return COMPUTE if kind == KERNEL else MEMORY

    def classify(self, ops: GpuOps) -> np.ndarray:
        """Class code per op, int8 ``[n]``."""
        n_names = len(ops.names)
        matched = np.full(n_names, -1, dtype=np.int64)
        for i, name in enumerate(ops.names):
            index = self.match(name)
            if index is not None:
                matched[i] = self._compiled[index][1]
        by_name = matched[ops.name_id] if n_names else np.zeros(len(ops), dtype=np.int64)
        fallback = np.where(ops.kind == KERNEL, COMPUTE, MEMORY)
        return np.where(by_name >= 0, by_name, fallback).astype(np.int8)

    def labels(self, ops: GpuOps) -> list[str | None]:
        """Label of the matching rule per distinct name (``ops.names`` order), None if unmatched."""
        out: list[str | None] = []
        for name in ops.names:
            index = self.match(name)
            out.append(None if index is None else self.rules[index].label)
        return out


def classify(ops: GpuOps, rules: Sequence[Rule] = DEFAULT_RULES) -> np.ndarray:
    """Class code per GPU op (int8 ``[n]``: 0 compute, 1 communication, 2 memory)."""
    return Classifier(rules).classify(ops)
