"""The bundled experiment YAMLs (data only: a package so that importlib.resources finds it)."""
