"""Feature maps phi: R^d -> R^D applied per head to queries and keys.

One small interface (after fast-transformers): ``forward(x)`` maps the last
dimension from ``head_dim`` to ``out_dim``, and ``redraw()`` draws new random
features (a no-op for deterministic maps). The attention layer calls
``redraw()`` once per training forward, so that queries and keys of one
forward share the same features, and otherwise only asks for phi and
``out_dim``.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

FEATURE_MAPS = ("linear", "performer", "dpfp")


def sum_normalize(phi, eps=1e-6):
    """phi / sum_j phi_j (paper Eq. 29), never NaN.

    Feature vectors of non-negative maps can be all zero (DPFP of a zero
    input); the denominator is clamped so such a vector stays zero instead of
    becoming 0/0.
    """
    return phi / phi.sum(-1, keepdim=True).clamp_min(eps)


class FeatureMap(nn.Module):
    """Base class: phi with its output size ``out_dim``."""

    def redraw(self):
        """Draw new random features; deterministic maps have none."""


class LinearFeatureMap(FeatureMap):
    """phi(x) = elu(x) + 1 (Katharopoulos et al.; paper Eq. 30). D = d."""

    def __init__(self, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.out_dim = head_dim

    def forward(self, x):
        return F.elu(x) + 1


class DPFPFeatureMap(FeatureMap):
    """Deterministic parameter-free projection, DPFP-nu (paper Eq. 37, Appendix C).

    r = [relu(x), relu(-x)] (size 2d), phi(x) = concat_{i=1..nu} r * roll(r, +i).
    D = 2 * d * nu.
    """

    def __init__(self, head_dim, nu=1):
        super().__init__()
        if not isinstance(nu, int) or nu < 1:
            raise ValueError(f"dpfp nu must be an integer >= 1, got {nu!r}")
        if nu >= 2 * head_dim:
            raise ValueError(f"dpfp nu must be < 2 * head_dim = {2 * head_dim}, got {nu}")
        self.head_dim = head_dim
        self.nu = nu
        self.out_dim = 2 * head_dim * nu

    def forward(self, x):
        r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
        rolled = torch.cat([r.roll(shifts=i, dims=-1) for i in range(1, self.nu + 1)], dim=-1)
        return r.repeat(*([1] * (r.dim() - 1)), self.nu) * rolled

    def extra_repr(self):
        return f"head_dim={self.head_dim}, nu={self.nu}"


class PerformerFeatureMap(FeatureMap):
    """FAVOR+ positive orthogonal random features (paper Eqs. 31-32).

    phi(x) = (2m)^-1/2 ([exp(P^T x - |x|^2/2); exp(-P^T x - |x|^2/2)] + 1e-4), D = 2m,
    so that E[phi(x) . phi(y)] ~= exp(x . y).

    The projection P (``d x m``) is a registered buffer, so a checkpoint holds
    the features evaluation uses. The attention layer calls ``redraw()`` at
    every training forward (paper Sec. 5.3); in eval mode P stays fixed. Draw
    number n uses a generator seeded with (seed, n), with n kept in the buffer
    ``num_draws``: runs, resumed runs and distributed ranks that share a seed
    draw the same features.
    """

    def __init__(self, head_dim, num_features=None, seed=None):
        super().__init__()
        num_features = head_dim if num_features is None else num_features
        if not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"performer num_features must be an integer >= 1, got {num_features!r}")
        self.head_dim = head_dim
        self.num_features = num_features
        self.out_dim = 2 * num_features
        seed = int(torch.randint(2**31 - 1, ()).item()) if seed is None else int(seed)
        # seed and draw count are buffers: a checkpoint resumes the same sequence of draws
        self.register_buffer("seed", torch.tensor(seed, dtype=torch.long))
        self.register_buffer("projection", torch.empty(head_dim, num_features))
        self.register_buffer("num_draws", torch.zeros((), dtype=torch.long))
        self.redraw()

    @torch.no_grad()
    def redraw(self):
        """Draw a new orthogonal random projection (deterministic given seed and count)."""
        gen = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + int(self.num_draws))
        self.projection.copy_(orthogonal_gaussian(self.head_dim, self.num_features, gen))
        self.num_draws += 1

    def forward(self, x):
        u = x @ self.projection.to(x.dtype)
        half_sq_norm = 0.5 * (x * x).sum(-1, keepdim=True)
        feats = torch.cat([torch.exp(u - half_sq_norm), torch.exp(-u - half_sq_norm)], dim=-1)
        return (feats + 1e-4) / math.sqrt(self.out_dim)

    def extra_repr(self):
        return f"head_dim={self.head_dim}, num_features={self.num_features}, seed={int(self.seed)}"


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


def build_feature_map(name, head_dim, **options):
    """Build a feature map by name: "linear", "performer" (num_features, seed) or "dpfp" (nu)."""
    builders = {
        "linear": LinearFeatureMap,
        "performer": PerformerFeatureMap,
        "dpfp": DPFPFeatureMap,
    }
    if name not in builders:
        raise ValueError(f"feature map must be one of {', '.join(FEATURE_MAPS)}; got {name!r}")
    return builders[name](head_dim, **options)
