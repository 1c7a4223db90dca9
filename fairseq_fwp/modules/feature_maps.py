"""Feature maps phi: R^d -> R^D applied per head to queries and keys.

One small interface (after fast-transformers): ``forward(x)`` maps the last
dimension from ``head_dim`` to ``out_dim``; ``training_step()`` is called
once per training forward of the whole model (``start_training_step``) so
that random maps can redraw their features on their schedule; and
``fix_features(draw)`` holds them at one numbered draw instead (a state
carried across segments is only meaningful in the features it was written
with). Both are no-ops for deterministic maps. Queries and keys of one
forward share the same features. The attention layer only asks for phi and
``out_dim``.

Why per model forward and not per attention call: fairseq's
``--checkpoint-activations`` runs every layer's forward a second time in the
backward pass, which must see the same features as the first.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layouts import fused

QK_NORMS = ("sum", "l2", "none")
FEATURE_MAPS = {}  # name -> FeatureMap subclass: the registry, in registration order


PROBE_HEAD_DIMS = (64, 128, 32, 16, 8)  # a registration is checked at the first the map can be built at


def register_feature_map(name):
    """Class decorator, in fairseq's style: registers a FeatureMap subclass under `name`, the value
    --fwp-feature-map takes. The class is built as cls(head_dim, **options) and has ``out_dim``, which the
    registration checks (mapped): at the first head size of PROBE_HEAD_DIMS (those of the built-in
    architectures) that it can be built at with its default options. A model checks its own head size when
    its arguments are parsed (attention_options.py)."""
    def register(cls):
        if not (isinstance(cls, type) and issubclass(cls, FeatureMap)):
            raise ValueError(f"feature map {name!r}: register a FeatureMap subclass, got {cls!r}")
        if name in FEATURE_MAPS or name == "softmax":
            raise ValueError(f"feature map {name!r} is registered already")
        _check_at_a_probe_size(name, cls)
        FEATURE_MAPS[name] = cls
        return cls
    return register


class UnbuildableError(ValueError):
    """A feature map that cannot be built at a head size (with these options)."""


def mapped(cls, head_dim, **options):
    """Builds cls(head_dim, **options) and maps a few vectors, without touching torch's random generator;
    raises UnbuildableError where it cannot be built, ValueError where it sets no out_dim or maps to another size."""
    with torch.random.fork_rng(devices=[]):
        try:
            phi = cls(head_dim, **options)
        except Exception as err:
            raise UnbuildableError(f"{cls.__name__}({head_dim}) cannot be built ({type(err).__name__}: {err})") from err
        try:
            got = phi(torch.randn(2, 3, head_dim)).shape[-1]
        except Exception as err:
            raise ValueError(f"{cls.__name__}({head_dim}) could not map vectors of size {head_dim} "
                             f"({type(err).__name__}: {err})") from err
    out_dim = getattr(phi, "out_dim", None)
    if not isinstance(out_dim, int):
        raise ValueError(f"{cls.__name__} sets no out_dim (in __init__: self.out_dim = D, the size of phi(x), which "
                         "the fast weights are D x Dv of)")
    if got != out_dim:
        raise ValueError(f"{cls.__name__}({head_dim}) says out_dim = {out_dim}, but maps vectors of size {head_dim} "
                         f"to size {got}")


def _check_at_a_probe_size(name, cls):
    unbuildable = []
    for head_dim in PROBE_HEAD_DIMS:
        try:
            return mapped(cls, head_dim)
        except UnbuildableError as err:
            unbuildable.append(str(err))
        except ValueError as err:
            raise ValueError(f"feature map {name!r}: {err}") from err
    raise ValueError(f"feature map {name!r} cannot be built at any head size of {PROBE_HEAD_DIMS} "
                     f"({'; '.join(unbuildable)}); a map takes the head size and keyword options with defaults")


def sum_normalize(phi, eps=1e-6):
    """phi / sum_j phi_j (paper Eq. 29), never NaN.

    Feature vectors of non-negative maps can be all zero (DPFP of a zero
    input); the denominator is clamped so such a vector stays zero instead of
    becoming 0/0.
    """
    return phi / phi.sum(-1, keepdim=True).clamp_min(eps)


def l2_normalize(phi, eps=1e-6):
    """phi / |phi|_2 (DeltaNet, Yang et al. 2024): with beta in (0, 1) the delta rule's
    beta |k|^2 <= 1 keeps it stable for signed features too. A zero vector stays zero."""
    return phi / phi.norm(dim=-1, keepdim=True).clamp_min(eps)


def normalize_features(phi, how):
    """The normalisation of phi(q), phi(k): "sum" (Eq. 29), "l2" or "none". The reference of the fused
    forms (normalized_features) that the layers run."""
    if how == "sum":
        return sum_normalize(phi)
    return l2_normalize(phi) if how == "l2" else phi


def normalized_features(phi, how, eps=1e-6):
    """normalize_features(phi, how) in one pass over phi forward, and two ("sum") or three ("l2") backward,
    each computed in float32 (float64 for float64) and written in phi's dtype and memory order: the ops read
    the features in their own dtype, so a float32 result (what autocast's float32 sum makes of a division)
    would only be cast back. Only the output and the per-vector sums are kept for the backward pass, which is
    differentiable again. Outside the fused glue (layouts.fused()): normalize_features itself."""
    if how == "none":
        return phi
    if not fused():
        return normalize_features(phi, how)
    if how == "sum":
        return _SumNormalized.apply(phi, False, eps)[0]
    return _L2Normalized.apply(phi, eps)[0]


def elu_plus_one(x):
    """elu(x) + 1 (Eq. 30) as x + 1 where x > 0 and exp(x) elsewhere: the same function, computed without elu(x)
    near -1 plus 1, which cancels where x is negative (at x = -8, float32 kept 4 of its digits, bfloat16 none),
    as the fused decoding step computes it (csrc/fast_weight_step.h). Where autograd records it, exp(min(x, 0)):
    no infinity for the gradient of the branch not taken to meet where x is large."""
    exp = torch.exp(x.clamp(max=0)) if torch.is_grad_enabled() and x.requires_grad else torch.exp(x)
    return torch.where(x > 0, x + 1, exp)


def _accumulation_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _SumNormalized(torch.autograd.Function):
    """Eq. 29, phi / sum_j phi_j (sums clamped to eps, as sum_normalize), of phi = x, or of phi = elu(x) + 1
    (through_elu: the linear map, Eq. 30, in the same passes; elu_plus_one, accurate where x is negative).

    Outputs: out = phi / S and 1 / S (the second kept for the backward pass, and an output so that the backward,
    a function of the outputs, is differentiable again). Backward, with r = g . out and g_S the gradient of
    1 / S: d phi = (g - r - g_S / S) / S (r and g_S's term 0 where the clamp holds S at eps); through elu,
    times elu'(x) = min(phi, 1): d x = (g - r - g_S / S) min(out, 1 / S)."""

    @staticmethod
    def forward(ctx, x, through_elu, eps):
        ctx.set_materialize_grads(False)
        with torch.autocast(x.device.type, enabled=False):
            phi = elu_plus_one(x) if through_elu else x
            total = phi.sum(-1, keepdim=True, dtype=_accumulation_dtype(x))
            unclamped = total >= eps
            inverse = total.clamp_min_(eps).reciprocal_()
            # through elu, phi is this function's own: divided in place
            out = phi.mul_(inverse) if through_elu else torch.mul(phi, inverse, out=torch.empty_like(phi))
        ctx.through_elu = through_elu
        ctx.save_for_backward(out, inverse, unclamped)
        return out, inverse

    @staticmethod
    def backward(ctx, g, g_inverse):
        out, inverse, unclamped = ctx.saved_tensors
        through_inverse = None if g_inverse is None else g_inverse.to(inverse.dtype) * inverse
        with torch.autocast(out.device.type, enabled=False):
            along = _along(g, out, unclamped, inverse.dtype, through_inverse)
            if torch.is_grad_enabled():  # create_graph: the same, out of place, differentiable again
                slope = torch.minimum(out.to(inverse.dtype), inverse) if ctx.through_elu else inverse
                return ((-along if g is None else g - along) * slope).to(out.dtype), None, None
            grad = torch.empty_like(out)
            g = torch.zeros_like(out) if g is None else g
            if ctx.through_elu:  # (g - r) min(out, 1 / S)
                torch.sub(g, along, out=grad).mul_(torch.minimum(out, inverse.to(out.dtype)))
            else:  # g / S - r / S
                torch.addcmul(along.mul_(inverse).neg_(), g, inverse, out=grad)
        return grad, None, None


def _along(g, out, unclamped, dtype, through_normaliser=None):
    """r = g . out per vector, in dtype, plus the gradient that reaches the normaliser through its own output
    (through_normaliser): the part of a normalisation's gradient along the output; 0 where the clamp held the
    normaliser at eps (a constant there). g: None where no gradient came."""
    along = (torch.zeros(unclamped.shape, dtype=dtype, device=out.device) if g is None
             else (g * out).sum(-1, keepdim=True, dtype=dtype))
    if through_normaliser is not None:
        along = along + through_normaliser
    return along * unclamped


class _L2Normalized(torch.autograd.Function):
    """phi / |phi|_2 (norms clamped to eps, as l2_normalize). Outputs: out and the clamped norm n (an output, so
    that the backward, a function of the outputs, is differentiable again). Backward: d phi = (g - r out) / n +
    g_n out, with r = g . out (r and g_n's term 0 where the clamp holds n at eps)."""

    @staticmethod
    def forward(ctx, phi, eps):
        ctx.set_materialize_grads(False)
        with torch.autocast(phi.device.type, enabled=False):
            norm = torch.linalg.vector_norm(phi, dim=-1, keepdim=True, dtype=_accumulation_dtype(phi))
            n = norm.clamp_min(eps)
            out = torch.div(phi, n, out=torch.empty_like(phi))
        ctx.save_for_backward(out, n, norm >= eps)
        return out, n

    @staticmethod
    def backward(ctx, g, g_n):
        out, n, unclamped = ctx.saved_tensors
        with torch.autocast(out.device.type, enabled=False):
            r = _along(g, out, unclamped, n.dtype)
            through_n = None if g_n is None else g_n * unclamped  # d n / d phi = out
            if torch.is_grad_enabled():  # create_graph: the same, out of place, differentiable again
                grad = -r * out / n if g is None else (g - r * out) / n
                return (grad if through_n is None else grad + through_n * out).to(out.dtype), None
            if g is None:
                grad = torch.mul(out, r, out=torch.empty_like(out)).neg_().div_(n)
            else:
                grad = torch.addcmul(g, out, r, value=-1, out=torch.empty_like(g)).div_(n)
            if through_n is not None:
                grad.addcmul_(out, through_n.to(out.dtype))
        return grad, None


class OptionError(ValueError):
    """A feature map's option that it cannot take; ``option`` names it (validate names its flag)."""

    def __init__(self, option, message):
        super().__init__(message)
        self.option = option


class FeatureMap(nn.Module):
    """Base class: phi with its output size ``out_dim``. ``signed``: its features can be negative (their
    sum can be zero: no sum normalisation, no attention normalisation)."""

    signed = False

    @classmethod
    def check_options(cls, head_dim, **options):
        """Raises OptionError for an option value this map cannot take with heads of `head_dim`; checked
        without building the map (building a random map draws from torch's generator)."""

    def training_step(self):
        """Called once before every training forward of the model; deterministic maps ignore it."""

    def fix_features(self, draw):
        """Use the features of draw number `draw` (0: those of initialisation) from now on, and stop
        redrawing them per training step; deterministic maps ignore it."""

    @property
    def draw(self):
        """The number of the features in use (random maps), or None (deterministic maps)."""
        return None

    def normalized(self, x, how):
        """phi(x) normalised as `how` says (normalize_features), its normalisation fused (normalized_features)."""
        return normalized_features(self(x), how)


def start_training_step(model):
    """Before a training forward of `model`: every random feature map advances its schedule."""
    for module in model.modules():
        if isinstance(module, FeatureMap):
            module.training_step()


def orthogonal_gaussian(d, m, generator):
    """A ``d x m`` matrix whose columns are orthogonal in blocks of d.

    Each column is rescaled to the norm of a d-dimensional Gaussian vector, so
    marginally every column is N(0, I) and the FAVOR+ estimate is unbiased.
    """
    blocks = []
    for _ in range(math.ceil(m / d)):
        g = torch.randn(d, d, generator=generator, dtype=torch.float64)
        q, _ = torch.linalg.qr(g)
        blocks.append(q)
    P = torch.cat(blocks, dim=1)[:, :m]
    norms = torch.randn(d, m, generator=generator, dtype=torch.float64).norm(dim=0)
    return (P * norms).float()


@register_feature_map("linear")
class LinearFeatureMap(FeatureMap):
    """phi(x) = elu(x) + 1 (Katharopoulos et al.; paper Eq. 30). D = d."""

    def __init__(self, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.out_dim = head_dim

    def forward(self, x):
        return elu_plus_one(x)

    def normalized(self, x, how):
        """Sum-normalised, the map and Eq. 29 together (_SumNormalized), for this map itself: a subclass (its own
        forward) and the unfused glue (layouts.fused()) take phi(x), then its normalisation."""
        if how == "sum" and type(self) is LinearFeatureMap and fused():
            return _SumNormalized.apply(x, True, 1e-6)[0]
        return super().normalized(x, how)


@register_feature_map("performer")
class PerformerFeatureMap(FeatureMap):
    """FAVOR+ positive orthogonal random features (paper Eqs. 31-32).

    phi(x) = (2m)^-1/2 ([exp(P^T x - |x|^2/2); exp(-P^T x - |x|^2/2)] + 1e-4), D = 2m,
    so that E[phi(x) . phi(y)] ~= exp(x . y).

    Options beyond the paper's formula:
    - ``redraw_interval``: new features every that many training forwards
      of the model (1: every mini-batch, the paper's Sec. 5.3; 0: never, the
      features drawn at initialisation stay). Evaluation never redraws.
    - ``input_scaling`` (default on, as --fwp-performer-scaling): multiply x by head_dim^-1/4 first, so that
      phi(q) . phi(k) estimates exp(q . k / sqrt(d)), the kernel of softmax
      attention, as Choromanski et al.'s own code does; without it the
      estimated kernel exp(q . k) is far peakier and its random-feature
      estimate far noisier.

    The projection P (``d x m``) is a registered buffer, so a checkpoint holds
    the features evaluation uses. Draw number n uses a generator seeded with
    (seed, n); n (``num_draws``) and the training forwards seen
    (``num_steps``) are buffers too: runs, resumed runs and distributed ranks
    that share a seed draw the same features at the same steps.
    """

    def __init__(self, head_dim, num_features=None, seed=None, redraw_interval=1, input_scaling=True):
        super().__init__()
        num_features = head_dim if num_features is None else num_features
        self.check_options(head_dim, num_features=num_features, redraw_interval=redraw_interval)
        self.head_dim = head_dim
        self.num_features = num_features
        self.out_dim = 2 * num_features
        self.redraw_interval = redraw_interval
        self.input_scale = head_dim ** -0.25 if input_scaling else 1.0
        seed = int(torch.randint(2**31 - 1, ()).item()) if seed is None else int(seed)
        # seed and counts are buffers: a checkpoint resumes the same sequence of draws
        self.register_buffer("seed", torch.tensor(seed, dtype=torch.long))
        self.register_buffer("projection", torch.empty(head_dim, num_features))
        self.register_buffer("num_draws", torch.zeros((), dtype=torch.long))
        self.register_buffer("num_steps", torch.zeros((), dtype=torch.long))
        self.redraw()

    @classmethod
    def check_options(cls, head_dim, num_features=None, seed=None, redraw_interval=1, input_scaling=True):
        if num_features is not None and (not isinstance(num_features, int) or num_features < 1):
            raise OptionError("num_features", f"performer num_features must be an integer >= 1, got {num_features!r}")
        if not isinstance(redraw_interval, int) or redraw_interval < 0:
            raise OptionError("redraw_interval",
                              f"performer redraw_interval must be an integer >= 0, got {redraw_interval!r}")

    @torch.no_grad()
    def redraw(self):
        """Draw a new orthogonal random projection (deterministic given seed and count)."""
        self._draw(int(self.num_draws))

    @torch.no_grad()
    def _draw(self, number):
        """Draw number `number` of this map's sequence (a generator seeded with (seed, number))."""
        gen = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + number)
        self.projection.copy_(orthogonal_gaussian(self.head_dim, self.num_features, gen))
        self.num_draws.fill_(number + 1)

    def fix_features(self, draw):
        self.redraw_interval = 0
        self._draw(draw)

    @property
    def draw(self):
        return int(self.num_draws) - 1

    @torch.no_grad()
    def training_step(self):
        """The first training forward uses the features drawn at initialisation."""
        if self.redraw_interval and self.num_steps > 0 and self.num_steps % self.redraw_interval == 0:
            self.redraw()
        self.num_steps += 1

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints written before num_steps existed redrew at every step: their count restarts.
        state_dict.setdefault(prefix + "num_steps", torch.zeros((), dtype=torch.long))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x):
        x = x * self.input_scale
        u = x @ self.projection.to(x.dtype)
        half_sq_norm = 0.5 * (x * x).sum(-1, keepdim=True)
        feats = torch.cat([torch.exp(u - half_sq_norm), torch.exp(-u - half_sq_norm)], dim=-1)
        return (feats + 1e-4) / math.sqrt(self.out_dim)

    def extra_repr(self):
        return (f"head_dim={self.head_dim}, num_features={self.num_features}, seed={int(self.seed)}, "
                f"redraw_interval={self.redraw_interval}, input_scaling={self.input_scale != 1.0}")


@register_feature_map("dpfp")
class DPFPFeatureMap(FeatureMap):
    """Deterministic parameter-free projection, DPFP-nu (paper Eq. 37, Appendix C).

    r = [relu(x), relu(-x)] (size 2d), phi(x) = concat_{i=1..nu} r * roll(r, +i).
    D = 2 * d * nu.
    """

    def __init__(self, head_dim, nu=1):
        super().__init__()
        self.check_options(head_dim, nu=nu)
        self.head_dim = head_dim
        self.nu = nu
        self.out_dim = 2 * head_dim * nu

    @classmethod
    def check_options(cls, head_dim, nu=1):
        if not isinstance(nu, int) or nu < 1:
            raise OptionError("nu", f"dpfp nu must be an integer >= 1, got {nu!r}")
        if nu >= 2 * head_dim:  # roll(r, 2 head_dim) is r itself: the blocks would repeat
            raise OptionError("nu", f"dpfp nu must be below 2 x head_dim = {2 * head_dim} (head_dim {head_dim}), "
                                    f"got {nu}")

    def forward(self, x):
        r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
        rolled = torch.stack([r.roll(shifts=i, dims=-1) for i in range(1, self.nu + 1)], dim=-2)
        return (r.unsqueeze(-2) * rolled).flatten(-2)  # block i: r * roll(r, i), without repeating r

    def extra_repr(self):
        return f"head_dim={self.head_dim}, nu={self.nu}"


@register_feature_map("silu")
class SiLUFeatureMap(FeatureMap):
    """phi(x) = x sigmoid(x) (DeltaNet, Yang et al. 2024; with L2 normalisation). D = d; signed."""

    signed = True

    def __init__(self, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.out_dim = head_dim

    def forward(self, x):
        return F.silu(x)


def feature_map_class(name):
    if name not in FEATURE_MAPS:
        raise ValueError(f"feature map {name!r} is not registered (registered: {', '.join(FEATURE_MAPS)}); a map of "
                         "your own is registered by its --user-dir (fairseq_fwp.register_feature_map)")
    return FEATURE_MAPS[name]


def build_feature_map(name, head_dim, **options):
    """Build a registered feature map by name: "linear", "performer" (num_features, seed, redraw_interval,
    input_scaling), "dpfp" (nu), "silu", or one of your own."""
    return feature_map_class(name)(head_dim, **options)
