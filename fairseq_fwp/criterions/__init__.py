"""Registers the plugin's fairseq criterions (decorators run on import)."""
from . import distillation  # noqa: F401
