"""tfdag's library layer: every pipeline stage as a plain function (no Prefect import)."""

__version__ = "0.1.0"
