"""The bundled engine profiles and their fits (data only: a package so that importlib.resources finds it)."""
