"""A --user-dir of one's own: a feature map, an update rule and an architecture, registered without editing
fairseq-fwp (docs/extending.md walks through it).

    fairseq-train DATA --user-dir examples/extend --arch fwp_transformer_hedgehog_longhorn ...
    fairseq-generate DATA --user-dir examples/extend --path CHECKPOINT --beam 4 ...
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.models import register_model_architecture

from fairseq_fwp import FeatureMap, UpdateRule, register_feature_map, register_update_rule
from fairseq_fwp.models.fwp_transformer import fwp_transformer_tiny


@register_feature_map("hedgehog")
class HedgehogFeatureMap(FeatureMap):
    """Hedgehog (Zhang et al., ICLR 2024): a learned map phi(x) = [softmax(W x), softmax(-W x)], which can
    learn the spiky, monotonic weights of softmax attention; D = 2d. W starts as the identity. Positive
    features: sum normalisation and attention normalisation apply."""

    def __init__(self, head_dim):
        super().__init__()
        self.proj = nn.Linear(head_dim, head_dim)
        nn.init.eye_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        self.out_dim = 2 * head_dim

    def forward(self, x):
        z = self.proj(x)
        return torch.cat([F.softmax(z, dim=-1), F.softmax(-z, dim=-1)], dim=-1)


@register_update_rule("longhorn")
class LonghornRule(UpdateRule):
    """Longhorn (Liu et al., 2024): every token solves its online regression in closed form,
    W_t = W_{t-1} + eps_t (v_t - W_{t-1} k_t) k_t^T with eps_t = beta_t / (1 + beta_t |k_t|^2): a delta rule
    whose step size shrinks with the key, stable for keys of any size. Only its step is written here: it
    trains on the reference backend (auto says so), decodes, carries over and checkpoints like the others."""

    write_strength = True  # beta_t from the layer input (Eq. 21)

    def step(self, memory, q, k, v, beta, decay):
        vbar, read = memory.read(torch.stack([k, q], dim=-2)).unbind(-2)  # W_{t-1} k, W_{t-1} q
        eps = beta / (1 + beta * (k * k).sum(-1))
        u = eps.unsqueeze(-1) * (v - vbar)
        memory.write_(k, u)
        return read + u * (k * q).sum(-1, keepdim=True)  # W_t q


@register_model_architecture("fwp_transformer", "fwp_transformer_hedgehog_longhorn")
def fwp_transformer_hedgehog_longhorn(args):
    """fwp_transformer_tiny with Hedgehog features at every attention and a Longhorn decoder; any --fwp-*
    flag given still wins."""
    args.fwp_feature_map = getattr(args, "fwp_feature_map", None) or "hedgehog"
    args.fwp_update_rule = getattr(args, "fwp_update_rule", None) or "longhorn"
    fwp_transformer_tiny(args)
