"""Helpers every layer may use: sizes, TOML files, a stats collector."""
