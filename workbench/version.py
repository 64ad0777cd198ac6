"""The package's version, in a module of its own so that any layer (the server's app,
the top-level package) can read it without importing the others."""

__version__ = "0.1.0"
