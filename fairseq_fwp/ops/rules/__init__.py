"""Update rules: what each token writes into the fast weight (the paper's programming instructions), one
registry, in fairseq's decorator style.

    @register_update_rule("longhorn")
    class LonghornRule(UpdateRule):
        write_strength = True
        def step(self, memory, q, k, v, beta, decay): ...

A rule declares what it needs from the layer (``write_strength``: beta_t per head, Eq. 21; ``decay``: a_t
per head, the gated rules), whether its keys must be normalised (``normalised_keys``), its one step
(``step``: the write of one token, then the read of the updated memory by its query), and the kernels
that run it faster (``kernels``: backend name -> backends.Kernel). A rule with no kernel at all runs on
its own step: trains (the reference backend, token by token), decodes, carries over and checkpoints;
``auto`` picks the reference for it and says why.

Every module of this folder is imported when the ops are: a new rule is one new file here (or, for a
user, a registration in their own --user-dir). The built-ins are sum.py and delta.py.

A registration is checked when it is made: a rule without its own step is refused. Kernels belong to the
class that wrote them: a rule runs only the ``kernels`` and the ``product`` form declared in its own class
body (``kernels = DeltaRule.kernels`` inherits them explicitly), so that a subclass with a step of its own
is never trained by its parent's kernels.
"""
import importlib
import pkgutil

UPDATE_RULES = {}
WRITE_FORMS = (None, "sum", "delta")  # UpdateRule.write_form


class UpdateRule:
    # beta_t in (0, 1) per head and token, from the layer input (Eq. 21); "channels": one per key channel and
    # one per value channel, beta ``[.., D + Dv]`` (GDN-2's erase and write gates)
    write_strength = False
    # a_t in [0, 1] per head and token, from the layer input (the gated rules); "channels": one per key channel,
    # a ``[.., D]`` (GLA, KDA)
    decay = False
    decay_form = "mamba2"  # the decay gate its paper builds (modules/gates.py), which --fwp-decay-form auto takes
    normalised_keys = False  # phi(k) must be normalised (sum or l2): the rule diverges without
    normalised_retrieval = False  # with attention normalisation, its retrieval W k is normalised too (Eqs. 26-28)
    # Each write is a generalised Householder transition I - beta k k^T: with beta in (0, 2) instead of (0, 1)
    # its eigenvalues lie in [-1, 1] instead of [0, 1] (--fwp-negative-eigenvalues), and the rule has a form
    # that writes several keys per token (``product``, the registered name of it: --fwp-householder-steps).
    householder = False
    product = None
    substeps = False  # k ``[.., N, D]``, v ``[.., N, Dv]`` and beta ``[.., N]``: N writes per token, in order
    # What each write is, for exact gradients of small per-channel decays given as decay= (ops/decay_columns.py):
    # "sum" (W' + v k^T) or "delta" (W' + beta (v - W' k) k^T), W' the decayed memory; None (any other step):
    # one extra pass of the op per step with such decays. Only the class's own declaration counts.
    write_form = None
    kernels = {}  # backend name -> backends.Kernel; every rule also runs on "reference" (its step)
    name = None  # set by register_update_rule

    def step(self, memory, q, k, v, beta, decay):
        """One token of every row: write k (and v, beta, decay) into `memory` (memory.py: decay_, read,
        write_), then return what the query q reads from the updated memory, ``[rows, H, Dv]``.

        q, k ``[rows, H, D]``, v ``[rows, H, Dv]``; beta ``[rows, H]`` or None; decay a ``[rows, H]`` (not its
        log: 0 is a full forget) or None, all in the memory's dtype (a rule with ``substeps``: k ``[rows, H, N,
        D]``, v ``[rows, H, N, Dv]``, beta ``[rows, H, N]``). Written once, it is both the
        reference (on a FunctionalMemory, token by token, in float64 for the oracles) and the decoding
        step (on a decoder's Memory, in place)."""
        raise NotImplementedError

    def __repr__(self):
        return f"<update rule {self.name!r}>"


def register_update_rule(name):
    """Class decorator: registers an UpdateRule subclass under `name`, the value --fwp-update-rule takes."""
    def register(cls):
        if not (isinstance(cls, type) and issubclass(cls, UpdateRule)):
            raise ValueError(f"update rule {name!r}: register an UpdateRule subclass, got {cls!r}")
        if name in UPDATE_RULES:
            raise ValueError(f"update rule {name!r} is registered already ({type(UPDATE_RULES[name]).__name__})")
        if cls.step is UpdateRule.step:
            raise ValueError(f"update rule {name!r}: {cls.__name__} has no step (def step(self, memory, q, k, v, beta, "
                             "decay), the write of one token and its query's read: docs/extending.md)")
        rule = cls()
        rule.name = name
        rule.kernels = dict(cls.__dict__.get("kernels", {}))  # its own, or none: not its parent's
        rule.product = cls.__dict__.get("product")
        rule.write_form = cls.__dict__.get("write_form")
        if rule.write_form not in WRITE_FORMS:
            raise ValueError(f"update rule {name!r}: write_form {rule.write_form!r} is none of {WRITE_FORMS}")
        UPDATE_RULES[name] = rule
        return cls
    return register


def update_rule(name):
    """The registered rule called `name` (an UpdateRule is returned as it is)."""
    if isinstance(name, UpdateRule):
        return name
    if name not in UPDATE_RULES:
        raise ValueError(f"update rule {name!r} is not registered (registered: {', '.join(UPDATE_RULES)}); "
                         "a rule of your own is registered by its --user-dir (fairseq_fwp.register_update_rule)")
    return UPDATE_RULES[name]


def rule_for(beta, decay):
    """The built-in rule of the contract's ops: fast_weight_sum (beta None) or fast_weight_delta, gated
    where a decay is given."""
    return UPDATE_RULES[("gated-" if decay is not None else "") + ("sum" if beta is None else "delta")]


# The built-ins first (the flag lists them in this order), then every other module of the folder.
for _name in ("sum", "delta", *sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in ("sum", "delta"))):
    importlib.import_module(f"{__name__}.{_name}")
