"""Beside the plugin, as fairseq keeps them: the paper's recipes, the synthetic benchmarks, the dual-form
analysis, the quickstart, speed benchmarks and a user's own --user-dir (extend/). Run from the repository
root, e.g. ``python -m examples.recipes.small_real_data ...``; their dependencies are the ``recipes`` extra
(``pip install -e .[recipes]``)."""
