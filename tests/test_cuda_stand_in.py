"""The CPU's stand-in of CUDA (tests/cuda_stand_in.py), on which the GPU tests' own code runs in CI: what CUDA
refuses across devices it refuses, what CUDA takes it takes, and every tensor says where it would be."""
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
