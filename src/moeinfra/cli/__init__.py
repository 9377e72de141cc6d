"""The ``moeinfra`` command line. Thin: parse, call the library, print."""
