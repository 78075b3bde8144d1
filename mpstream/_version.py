"""The mpstream version (one place, importable without the package's heavy parts)."""

__version__ = "0.1.0"
