"""The package version: a leaf module, so that any layer can stamp it (run datasets, reports)
without importing the package's public surface (__init__ sits above every layer)."""

__version__ = "0.1.0"
