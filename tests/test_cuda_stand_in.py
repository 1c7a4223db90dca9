"""The CPU's stand-in of CUDA (tests/cuda_stand_in.py), on which the GPU tests' own code runs in CI: what CUDA
refuses across devices it refuses, what CUDA takes it takes, and every tensor says where it would be."""
import contextlib

import pytest
import torch

from cuda_stand_in import CUDA, CPU, CudaStandIn, cuda_stood_in_for
from helpers import make_inputs, outputs_and_grads, relative_errors

SAME_DEVICE = "Expected all tensors to be on the same device"


@pytest.fixture
def stand_in():
    with CudaStandIn() as mode:
        yield mode


def test_a_tensor_sent_to_cuda_says_so_and_its_results_stay_there(stand_in):
    host = torch.randn(3, 4)
    for sent in (host.cuda(), host.to("cuda"), host.to("cuda", torch.float64), torch.zeros(3, 4, device="cuda"),
                 torch.zeros(3, 4, device=torch.device("cuda", 0)), host.to(host.cuda())):
        assert sent.device == torch.device("cuda", 0) and sent.is_cuda and sent.get_device() == 0
        for result in (sent * 2, sent[0], sent.double(), torch.cat([sent, sent]), sent.new_zeros(2), sent.sum()):
            assert result.device.type == CUDA
    assert host.device.type == CPU and not host.is_cuda  # sending copies; the tensor left behind stays
    assert host.cuda().cpu().device.type == CPU


def test_cuda_tensors_mixed_with_cpu_ones_fail_as_on_cuda(stand_in):
    host, sent = torch.randn(3, 4), torch.randn(3, 4).cuda()
    for mixed in (lambda: sent - host, lambda: host * sent, lambda: torch.equal(sent, host),
                  lambda: torch.cat([sent, host]), lambda: host[sent.long() % 3]):
        with pytest.raises(RuntimeError, match=SAME_DEVICE):
            mixed()
    with pytest.raises(AssertionError, match="device"):
        torch.testing.assert_close(sent, host)
    with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
        sent.numpy()
    with pytest.raises(RuntimeError, match="generator"):
        torch.randn(2, device="cuda", generator=torch.Generator())


def test_what_cuda_takes_across_devices_is_taken(stand_in):
    host, sent = torch.randn(3, 4), torch.randn(3, 4).cuda()
    assert (sent * torch.tensor(2.0)).is_cuda  # a CPU scalar
    assert sent[torch.tensor([0, 2])].is_cuda  # CPU indices
    copy = torch.empty(3, 4).copy_(sent)
    assert not copy.is_cuda and torch.equal(copy, sent.cpu())
    sent[0] = host[1]
    assert sent.is_cuda


def test_a_modules_parameters_and_gradients_are_placed(stand_in):
    layer = torch.nn.Linear(4, 2).cuda()
    assert all(p.is_cuda for p in layer.parameters())
    x = torch.randn(3, 4).cuda().requires_grad_()
    (layer(x) ** 2).sum().backward()
    assert x.grad.is_cuda and layer.weight.grad.is_cuda
    (dx,) = torch.autograd.grad((layer(x) ** 2).sum(), [x])
    assert dx.is_cuda
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        layer(torch.randn(3, 4))


def test_a_gpu_result_compared_with_a_cpu_one_fails(monkeypatch):
    """The GPU check's 2026-11-28 failure of the csrc kernels' half-type tests: the kernels' results on CUDA
    against exact arithmetic on the CPU; one device for both compares."""
    inputs = make_inputs(1, 2, 9, 8, 4, dtype=torch.float32)
    with cuda_stood_in_for(monkeypatch):
        got = outputs_and_grads("delta", [x.detach().cuda().requires_grad_() for x in inputs], "cuda")
        assert all(x.is_cuda for x in got.values())
        with pytest.raises(RuntimeError, match=SAME_DEVICE):
            relative_errors(got, outputs_and_grads("delta", inputs, "reference"))
        on_one_device = outputs_and_grads("delta", [x.detach().cuda().requires_grad_() for x in inputs], "reference")
        assert max(relative_errors(got, on_one_device).values()) < 1e-5


# -- the GPU tests are as strong on the stand-in as the kernels they check need: each fails on an assertion where
# -- the stand-in's kernels err as a faulty kernel would


@contextlib.contextmanager
def perturbed_kernels(monkeypatch, perturb):
    """Inside cuda_stood_in_for: every output of the stand-in's kernels (fla's, and the csrc extension's CPU twin for
    its CUDA kernels and the fused step) passed through perturb(tensor)."""
    from fairseq_fwp.ops import cuda as kernels
    from fairseq_fwp.ops.protocol import Kernel
    from fairseq_fwp.ops.rules import UPDATE_RULES

    def perturbed(results):
        if isinstance(results, torch.Tensor):
            return perturb(results) if results.is_floating_point() else results
        return type(results)(perturbed(x) for x in results) if isinstance(results, (tuple, list)) else results

    def wrapped(function):
        return lambda *args: perturbed(function(*args))

    for rule in UPDATE_RULES.values():
        if "fla" in rule.kernels:
            fla = rule.kernels["fla"]
            monkeypatch.setitem(rule.kernels, "fla", Kernel(wrapped(fla.sequence), wrapped(fla.final_state),
                                                            wrapped(fla.step_), fla.unfit_reason))
    extension = kernels._extension

    class Perturbed:
        def __getattr__(self, name):
            value = getattr(extension, name)
            return wrapped(value) if callable(value) and name != "has_cuda_kernels" else value

    monkeypatch.setattr(kernels, "_extension", Perturbed())
    yield


def fails_on_an_assertion(test, *args):
    with pytest.raises(AssertionError):
        test(*args)


def test_the_decoding_test_fails_where_full_forward_and_steps_err_alike(monkeypatch):
    import test_attention

    with cuda_stood_in_for(monkeypatch), perturbed_kernels(monkeypatch, lambda t: t * (1 + 1e-3)):
        fails_on_an_assertion(test_attention.test_gpu_decoding_equals_full_forward, "stand-in", "sum", torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_half_type_tests_fail_on_a_one_percent_error(monkeypatch, dtype):
    import test_fla
    import test_kernels

    with cuda_stood_in_for(monkeypatch), perturbed_kernels(monkeypatch, lambda t: t * 1.01):
        fails_on_an_assertion(test_fla.test_gpu_half_types_match_reference, "stand-in", "delta", dtype,
                              test_fla.STAND_IN_SHAPES[0])
        fails_on_an_assertion(test_kernels.test_gpu_kernels_half_types, "sum", dtype, "stand-in")


def test_the_determinism_test_fails_on_a_kernel_that_is_not(monkeypatch):
    import test_kernels

    noise = torch.Generator().manual_seed(0)  # a new draw at every call
    with cuda_stood_in_for(monkeypatch), perturbed_kernels(
            monkeypatch, lambda t: t + 1e-6 * t.abs().max() * torch.randn(t.shape, generator=noise).to(t)):
        fails_on_an_assertion(test_kernels.test_gpu_kernels_are_deterministic, "sum", "stand-in")
