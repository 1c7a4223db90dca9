"""fairseq-fwp: fast-weight programmers for fairseq (use with --user-dir).

Importing the package applies the compatibility fixes (compat.py) and
registers the models, architectures, tasks and criterion. The extension
points, in fairseq's decorator style beside its register_model_architecture:
``register_feature_map`` (a FeatureMap subclass) and ``register_update_rule``
(an UpdateRule subclass); docs/extending.md. ``fairseq_fwp.ops`` is pure
torch and does not need fairseq.
"""
from .modules.feature_maps import FeatureMap, OptionError, register_feature_map
from .ops.rules import UpdateRule, register_update_rule

try:
    import fairseq  # noqa: F401
except ImportError:  # ops-only use: nothing to register
    fairseq = None

if fairseq is not None:
    from . import compat, criterions, models, tasks  # noqa: F401
    from .dual_form import task as dual_form_task  # noqa: F401  (registers --task dual_form_language_modeling)

    compat.apply()

__all__ = ["FeatureMap", "OptionError", "UpdateRule", "register_feature_map", "register_update_rule"]
