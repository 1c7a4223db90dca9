"""Cutting sequences into chunks: what chunked.py and chunked_gated.py share."""
import torch.nn.functional as F

DEFAULT_CHUNK_SIZE = 64


def default_chunk_size(feature_dim):
    """Chunk length C for feature size D.

    The C x C work (the triangular solve, C^2 D products) must not swamp the
    D-sized work: measured fwd+bwd on the 2-core CPU (docs/benchmarks.md),
    C = 32 is 2.7x faster than C = 64 at D = 16, and C = 64 is best at
    D = 64 and D = 128.
    """
    return 32 if feature_dim <= 32 else DEFAULT_CHUNK_SIZE


def to_chunks(x, chunk):
    """[B, H, T, *F] -> [B, H, N, C, *F], zero-padding T up to N * C.

    Zero keys (and zero beta) at padded positions write nothing, so the final
    state is unaffected; padded outputs are sliced off by the caller.
    """
    T = x.shape[2]
    pad = (-T) % chunk
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    # Contiguous chunks: inputs are often permuted views ([T, B, H, d] memory),
    # and batched matmuls on such strides fall back to one matrix at a time.
    return x.reshape(*x.shape[:2], -1, chunk, *x.shape[3:]).contiguous()


def from_chunks(x, T):
    """[B, H, N, C, F] -> [B, H, T, F] (drops the padding)."""
    return x.reshape(*x.shape[:2], -1, x.shape[-1])[:, :, :T]
