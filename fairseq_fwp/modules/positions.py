"""Token positions while decoding incrementally, by each row's own count of tokens read.

fairseq's positional embeddings number a whole prefix with make_positions (padding skipped: a left-padded
row starts at 1), but a decoding step by the length of the prefix, padding included, one token at a time.
A decoder that reads several tokens at once (a prompt), or padding in a step (a row that reads nothing at
that step), numbers every token as make_positions numbers the whole prefix: by the row's count of tokens that
are not padding. `period`: positions restart every `period` tokens, as fwp_stream_lm's segments restart them.
"""
import torch
import torch.nn.functional as F
from fairseq.modules import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding


def positions_after(counts, keep, padding_idx, period=None):
    """The positions of new tokens ``[rows, T]`` where each row has read `counts` ``[rows]`` tokens before and
    keep ``[rows, T]`` marks the tokens that are not padding (whose position is padding_idx, as make_positions
    gives them); and the counts after them."""
    index = counts.unsqueeze(1) + keep.long().cumsum(1) - 1  # 0-based, among the row's tokens
    if period is not None:
        index = index % period
    return (index + padding_idx + 1).masked_fill(~keep, padding_idx), counts + keep.sum(1)


def embedded(embed_positions, positions):
    """What a fairseq positional embedding gives at these positions ``[rows, T]``: ``[rows, T, C]``."""
    if isinstance(embed_positions, LearnedPositionalEmbedding):
        return F.embedding(positions, embed_positions.weight, embed_positions.padding_idx)
    if isinstance(embed_positions, SinusoidalPositionalEmbedding):
        needed = int(positions.max()) + 1 if positions.numel() else 0  # a batch of no rows (--beam 0) needs none
        if needed > embed_positions.weights.size(0):  # as its forward grows the table for a longer input
            embed_positions.weights = SinusoidalPositionalEmbedding.get_embedding(
                needed, embed_positions.embedding_dim, embed_positions.padding_idx).to(embed_positions.weights)
        return embed_positions.weights.index_select(0, positions.flatten()).view(*positions.shape, -1)
    raise TypeError(f"decoding with {type(embed_positions).__name__} positions: only fairseq's learned and "
                    "sinusoidal positions are numbered per row")


def future_mask(length, new, like):
    """The additive mask of `new` queries over `length` earlier keys and their own: query i sees keys up to
    length + i. ``[new, length + new]``, 0 or -inf, in like's dtype and device."""
    mask = torch.full((new, length + new), float("-inf"), dtype=like.dtype, device=like.device)
    return mask.triu_(length + 1)
