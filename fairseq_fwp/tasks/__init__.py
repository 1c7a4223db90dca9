"""Registers the plugin's fairseq tasks (decorators run on import)."""
from . import stream_lm  # noqa: F401
