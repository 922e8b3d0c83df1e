"""The release, in one place (pyproject.toml's version is the same)."""

__version__ = "0.1.0"
