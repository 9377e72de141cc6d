"""Simulate the first hours of DeepSeek's published day, then the same traffic on B200 nodes.

Run: ``.venv/bin/python examples/serving_day.py``.
"""

from moeinfra.serving import build_scenario
from moeinfra.serving.scenario import published_vs_simulated

h800 = build_scenario(hours=3).run()
print("H800, first 3 hours of the published day")
for label, _, simulated, _ in published_vs_simulated(h800.totals):
    print(f"  {label:45s} {simulated:,.4g}")

# Same demand on B200 with the DeepSeek node curve: same nodes, faster steps.
b200 = build_scenario(hours=3, hardware_name="b200").run()
for name, result in (("h800", h800), ("b200", b200)):
    t = result.to_dict(hourly=False)
    print(
        f"{name}: cost ${t['cost_usd']:,.0f}, margin {t['margin']:.0%}, "
        f"speed {t['mean_output_tokens_per_s']:.1f} tok/s, TTFT p95 {t['ttft_s']['p95']:.2f} s"
    )
