"""One layer that tracks a state: token embedding, one attention with a residual, an MLP with a residual,
and a readout of the state at every position. No positional encoding: what the attention carries is all
the model knows of the past."""
import torch
import torch.nn as nn

from fairseq_fwp.modules.attention_options import AttentionOptions
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention


class CausalSoftmax(nn.Module):
    """Softmax attention over the past (the baseline), with FastWeightAttention's calling convention."""

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.attention = nn.MultiheadAttention(embed_dim, num_heads)

    def forward(self, x, key, value):
        T = x.shape[0]
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        return self.attention(x, x, x, attn_mask=future, need_weights=False)


class Block(nn.Module):
    def __init__(self, embed_dim, attention):
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.attention = attention
        self.mlp = nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.GELU(), nn.Linear(4 * embed_dim, embed_dim))

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x), None, None)[0]
        return x + self.mlp(self.mlp_norm(x))


class StateTracker(nn.Module):
    """options: a dict of AttentionOptions fields, or None for softmax attention."""

    def __init__(self, task, options, embed_dim=64, num_heads=4, layers=1):
        super().__init__()
        self.embed = nn.Embedding(task.vocab, embed_dim)
        make = (lambda: CausalSoftmax(embed_dim, num_heads)) if options is None else (
            lambda: FastWeightAttention(AttentionOptions(embed_dim, num_heads, **options)))
        self.blocks = nn.ModuleList([Block(embed_dim, make()) for _ in range(layers)])
        self.norm = nn.LayerNorm(embed_dim)
        self.readout = nn.Linear(embed_dim, task.classes)

    def forward(self, tokens):
        """tokens ``[B, T]`` -> logits of the state after each token ``[B, T, classes]``."""
        x = self.embed(tokens).transpose(0, 1)
        for block in self.blocks:
            x = block(x)
        return self.readout(self.norm(x)).transpose(0, 1)
