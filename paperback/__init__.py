"""paperback: run large language models lighter."""

__version__ = "0.1.0"
