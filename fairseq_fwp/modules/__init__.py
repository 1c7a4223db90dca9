"""Layers: feature maps and the fairseq-compatible fast-weight attention."""
