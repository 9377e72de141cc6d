"""One module per model architecture (see :mod:`moeinfra.engine.registry`)."""
