"""The version of this cxlkv (pyproject.toml reads it from here)."""
__version__ = "0.2.0"
