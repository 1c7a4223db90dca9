"""Errors of the fast-weight ops."""


class BackendUnavailableError(RuntimeError):
    """A backend was requested that cannot run in this installation."""


def refuse_a_second_derivative(name):
    """In a kernel's backward pass: raises where autograd records it (create_graph=True, for a second derivative
    such as a gradient penalty), which the kernel's backward, written for speed with in-place ops, cannot give."""
    import torch

    if torch.is_grad_enabled():
        raise BackendUnavailableError(
            f"backend {name!r} cannot differentiate this call twice: its backward pass is differentiable once, and "
            "a second derivative was asked (create_graph=True: a gradient penalty, meta-learning); backend "
            "'reference' (--fwp-backend reference: pure torch ops) gives it")
