"""MTP acceptance for the serving model: a number, or what a running system measured.

The serving model drafts one token per request per decode step (DeepSeek-V3's deployment: one MTP
module, one draft), so the acceptance it needs is the share of *first* drafts accepted: accepted
drafts at position 0 over verification rounds that had drafts. A system that drafts ``k > 1``
tokens measures that same first-position share (a later draft counts only after the first was
accepted), so its figure feeds the one-draft model as well; the all-positions rate
(``accepted / draft tokens``) would not.

Sources, read by :func:`read_mtp_acceptance`:

* a number in ``[0, 1)`` (``"0.85"``: DeepSeek-V3's report; 0: MTP off);
* a Prometheus text exposition from ``moeinfra serve up``'s ``GET /metrics`` (a saved file or an
  ``http(s)://`` URL): its ``moeinfra:spec_decode_num_drafts`` and
  ``moeinfra:spec_decode_num_accepted_tokens_per_pos{position="0"}`` counters, vLLM's metric names
  with our prefix (vLLM's own ``vllm:`` counters are read the same way; series with other labels,
  such as vLLM's per-engine ones, are summed).

Parsing uses ``prometheus_client``'s text parser (installed with ``moeinfra[serve]``).
"""

from __future__ import annotations

import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from moeinfra.errors import InputError

PREFIXES = ("moeinfra", "vllm")
_DRAFTS = "spec_decode_num_drafts"
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
_ALLOWED = "a number in [0, 1) (0: off), or a /metrics file or http(s):// URL of moeinfra serve up"


@dataclass(frozen=True)
class MtpAcceptance:
    """The share of first MTP drafts accepted, and where it came from.

    Attributes:
        acceptance: accepted first drafts / verification rounds with drafts, in [0, 1).
        source: ``"given"`` for a number, else the file or URL it was measured from.
        drafts: verification rounds with drafts counted (None for a given number).
        accepted_per_position: accepted drafts at draft positions 0, 1, ... ``[k]`` (empty for a
            given number).
    """

    acceptance: float
    source: str = "given"
    drafts: int | None = None
    accepted_per_position: tuple[int, ...] = ()

    @property
    def measured(self) -> bool:
        return self.drafts is not None

    @property
    def per_position(self) -> tuple[float, ...]:
        """Accepted drafts at each position over verification rounds with drafts ``[k]``."""
        if not self.drafts:
            return ()
        return tuple(a / self.drafts for a in self.accepted_per_position)

    def to_dict(self) -> dict:
        return {
            "acceptance": self.acceptance,
            "source": self.source,
            "verification_rounds_with_drafts": self.drafts,
            "acceptance_per_position": list(self.per_position) if self.measured else None,
        }

    def describe(self) -> str:
        """``MTP acceptance 0.35, measured: 1,234 of 3,520 first drafts accepted (m.txt)``."""
        from moeinfra.numfmt import format_number

        head = f"MTP acceptance {format_number(self.acceptance)}"
        if not self.measured:
            return f"{head} ({self.source})"
        return (
            f"{head}, measured: {format_number(self.accepted_per_position[0])} of "
            f"{format_number(self.drafts)} first drafts accepted ({self.source})"
        )


def acceptance_from_metrics(
    text: str, where: str = "metrics", option: str = "mtp_acceptance"
) -> MtpAcceptance:
    """The first-draft acceptance in a Prometheus text exposition ``text`` (``GET /metrics``).

    ``where`` (the file or URL) and ``option`` name the source in errors and in the result.
    Raises :class:`InputError` when the text is not Prometheus text, has no ``spec_decode``
    counters, counts no verification round with drafts, or gives an acceptance outside (0, 1).
    """
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        raise InputError(
            f"{option}={where}: reading /metrics needs prometheus-client "
            "(pip install 'moeinfra[serve]'), or give the acceptance as a number"
        ) from None
    totals: dict[str, float] = {}
    per_pos: dict[str, dict[int, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name.removesuffix("_total")
                prefix, _, metric = name.partition(":")
                if prefix not in PREFIXES:
                    continue
                if metric == _DRAFTS:
                    totals[prefix] = totals.get(prefix, 0.0) + sample.value
                elif metric == _PER_POS and sample.labels.get("position", "").isdigit():
                    at = per_pos.setdefault(prefix, {})
                    pos = int(sample.labels["position"])
                    at[pos] = at.get(pos, 0.0) + sample.value
    except ValueError as exc:  # the parser's error for a line that is not Prometheus text
        raise InputError(f"{option}={where}: not a Prometheus text exposition ({exc})") from None
    prefix = next((p for p in PREFIXES if p in totals or p in per_pos), None)
    if prefix is None:
        raise InputError(
            f"{option}={where}: no {PREFIXES[0]}:{_DRAFTS} counters (was the server started "
            "with --speculative-tokens?)"
        )
    if prefix not in totals or 0 not in per_pos.get(prefix, {}):
        missing = f"{_DRAFTS}" if prefix not in totals else f'{_PER_POS}{{position="0"}}'
        raise InputError(f"{option}={where}: has {prefix}:spec_decode counters but no {missing}")
    drafts = round(totals[prefix])
    positions = per_pos[prefix]
    accepted = tuple(round(positions.get(i, 0.0)) for i in range(max(positions) + 1))
    if drafts <= 0:
        raise InputError(
            f"{option}={where}: 0 verification rounds with drafts (no request has decoded with "
            "MTP drafts yet)"
        )
    acceptance = accepted[0] / drafts
    if not 0.0 < acceptance < 1.0:
        raise InputError(
            f"{option}={where}: measured acceptance {acceptance:.4g} ({accepted[0]} of {drafts} "
            "first drafts accepted) must be in (0, 1): the serving model reads 0 as MTP off and "
            "cannot take every draft accepted"
        )
    return MtpAcceptance(acceptance, where, drafts, accepted)


def _fetch(url: str, option: str, timeout_s: float) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.path in ("", "/"):  # the server's address: its metrics are at /metrics
        url = urllib.parse.urlunsplit(parts._replace(path="/metrics"))
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read().decode("utf-8")
    except urllib.error.HTTPError as exc:
        raise InputError(f"{option}={url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise InputError(f"{option}={url}: cannot fetch ({exc.reason})") from None
    except TimeoutError:
        raise InputError(f"{option}={url}: no answer within {timeout_s:g} s") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{option}={url}: cannot fetch ({exc})") from None


def read_mtp_acceptance(
    value: str | float, option: str = "mtp_acceptance", timeout_s: float = 10.0
) -> MtpAcceptance:
    """``value`` as MTP acceptance: a number in [0, 1), a saved ``/metrics`` file, or an
    ``http(s)://`` URL of a running server's ``/metrics`` (fetched within ``timeout_s`` seconds;
    a bare ``http://host:port`` gets ``/metrics`` appended).

    ``option`` names the argument in errors (the CLI passes ``--mtp-acceptance``).
    """
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None:
        if not (math.isfinite(number) and 0.0 <= number < 1.0):
            raise InputError(f"{option}={text} must be {_ALLOWED}")
        return MtpAcceptance(number)
    if text.lower().startswith(("http://", "https://")):
        return acceptance_from_metrics(_fetch(text, option, timeout_s), text, option)
    path = Path(text)
    if path.is_dir():
        raise InputError(f"{option}={text}: is a folder, expected {_ALLOWED}")
    if not path.is_file():
        raise InputError(f"{option}={text}: no such file, expected {_ALLOWED}")
    try:
        body = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{option}={text}: cannot read ({exc})") from None
    return acceptance_from_metrics(body, text, option)
