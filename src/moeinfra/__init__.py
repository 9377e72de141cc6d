"""moeinfra: DeepSeek-style Mixture-of-Experts infrastructure in Python.

Packages (top uses bottom): ``cli``/``report`` -> ``serving`` -> ``moe`` / ``pipeline`` / ``trace``
-> ``eplb``. See the README for usage.
"""

__version__ = "0.1.0"
