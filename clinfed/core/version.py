"""clinfed's version (the package's own, imported by what records it)."""

__version__ = "0.1.0"
