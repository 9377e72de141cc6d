"""``python -m moeinfra``: the ``moeinfra`` command."""

from moeinfra.cli.main import main

main()
