"""Input checks for the fast-weight ops: clear ValueErrors that name the tensor."""
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _describe(shape):
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _check_tensor(name, x, expected_shape, ref):
    """expected_shape holds ints or symbolic names (str) that match anything."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != len(expected_shape) or any(
        isinstance(e, int) and e != s for e, s in zip(expected_shape, x.shape)
    ):
        raise ValueError(
            f"{name} has shape {_describe(x.shape)}, expected {_describe(expected_shape)}"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}, expected a floating dtype")
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device}, but q is on {ref.device}")


def check_inputs(q, k, v, beta=None, state=None, decay=None, log_decay=None, substeps=False, channel_decay=False,
                 channel_strength=False):
    """Validate the contract layouts (any mix of floating dtypes); returns (B, H, T, D, Dv). substeps: a
    rule with N writes per token (k ``[B, H, T, N, D]``, v ``[B, H, T, N, Dv]``, beta ``[B, H, T, N]``);
    channel_decay: a decay per key channel ``[B, H, T, D]``; channel_strength: beta ``[B, H, T, D + Dv]``."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        shape = _describe(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must have shape [B, H, T, D], got {shape}")
    B, H, T, D = q.shape
    N = _substeps(k, substeps, 3)
    _check_tensor("q", q, ("B", "H", "T", "D"), q)
    _check_tensor("k", k, (B, H, T, *N, D), q)
    _check_tensor("v", v, (B, H, T, *N, "Dv"), q)
    Dv = v.shape[-1]
    if beta is not None:
        _check_tensor("beta", beta, (B, H, T, *N, *((D + Dv,) if channel_strength else ())), q)
    if state is not None:
        _check_tensor("state", state, (B, H, Dv, D), q)
    if decay is not None and log_decay is not None:
        raise ValueError("give decay or log_decay, not both")
    for name, gate in (("decay", decay), ("log_decay", log_decay)):
        if gate is not None:
            _check_tensor(name, gate, (B, H, T, *((D,) if channel_decay else ())), q)
    return B, H, T, D, Dv


def check_step_inputs(q, k, v, beta=None, log_decay=None, substeps=False, channel_decay=False,
                      channel_strength=False):
    """The layouts of one decoding step: q, k ``[B, H, D]``, v ``[B, H, Dv]``, beta and log_decay ``[B, H]``
    (substeps: k ``[B, H, N, D]``, v ``[B, H, N, Dv]``, beta ``[B, H, N]``; channel_decay: log_decay
    ``[B, H, D]``; channel_strength: beta ``[B, H, D + Dv]``)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        shape = _describe(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must have shape [B, H, D], got {shape}")
    B, H, D = q.shape
    N = _substeps(k, substeps, 2)
    _check_tensor("q", q, ("B", "H", "D"), q)
    _check_tensor("k", k, (B, H, *N, D), q)
    _check_tensor("v", v, (B, H, *N, "Dv"), q)
    if beta is not None:
        _check_tensor("beta", beta, (B, H, *N, *((D + v.shape[-1],) if channel_strength else ())), q)
    if log_decay is not None:
        _check_tensor("log_decay", log_decay, (B, H, *((D,) if channel_decay else ())), q)


def _substeps(k, substeps, axis):
    """(N,) for a rule with N writes per token (N read from k's axis `axis`), else ()."""
    if not substeps:
        return ()
    if not isinstance(k, torch.Tensor) or k.dim() <= axis + 1:
        shape = _describe(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__
        raise ValueError(f"k must have a writes-per-token axis N before D, got {shape}")
    return (k.shape[axis],)
