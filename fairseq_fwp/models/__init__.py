"""Registers the fairseq models and architectures (decorators run on import)."""
from . import fwp_transformer, fwp_transformer_lm  # noqa: F401
