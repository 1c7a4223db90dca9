"""fairseq-fwp: fast-weight programmers for fairseq (use with --user-dir).

Importing the package applies the compatibility fixes (compat.py) and
registers the models and architectures. ``fairseq_fwp.ops`` is pure torch
and does not need fairseq.
"""
try:
    import fairseq  # noqa: F401
except ImportError:  # ops-only use: nothing to register
    fairseq = None

if fairseq is not None:
    from . import compat, criterions, models, tasks  # noqa: F401
    from .dual_form import task as dual_form_task  # noqa: F401  (registers --task dual_form_language_modeling)

    compat.apply()
