"""Registers the plugin's fairseq tasks (decorators run on import)."""
from . import language_modeling, stream_lm  # noqa: F401
