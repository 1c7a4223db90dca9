"""CUDA stood in for by the CPU, so that every GPU test's own code (its setup, device moves, dtypes and
comparisons) runs in CI, where there is no GPU.

Inside ``CudaStandIn()``, a tensor sent to CUDA (``.cuda()``, ``.to("cuda")``, ``device="cuda"``, a module's
``.cuda()``) is computed on the CPU but says it is on ``cuda:0``, and an op that mixes it with a tensor on the CPU
raises what CUDA raises ("Expected all tensors to be on the same device"): a test that compares its GPU result
with one it computed on the CPU fails here as it would on a GPU. What CUDA takes across devices is taken:
copies (``copy_``, ``.to``, ``.data =``, item assignment), a zero-dimensional CPU tensor as a scalar, CPU
indices into a CUDA tensor.

Where a tensor lives is kept per storage (views and ``.data =`` share it), for the mode's lifetime. A tensor
made where the mode cannot see (the autograd engine's gradients inside a backward, a C++ extension's outputs:
``placed_like`` places those) lives nowhere in particular: it mixes with either, and an op of it with a placed
tensor places the result. ``torch.cuda``'s own functions (streams, memory, device properties) are not stood in
for: a GPU test that calls them runs on a GPU only.

``cuda_stood_in_for`` opens the mode with the kernels the GPU tests run computed on the CPU (the csrc
extension's CPU twin, each rule's chunked form for fla); tests/conftest.py's ``gpu`` fixture runs a GPU test
there.
"""
import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fairseq_fwp.ops.protocol import Kernel

CUDA, CPU = "cuda", "cpu"
STAND_IN_DEVICE = torch.device("cuda", 0)
H100_SHARED_MEMORY = 227 * 1024  # opt-in shared memory per block, which the csrc kernels' launches are sized by
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
# What CUDA does across devices: copies (the result lives where the destination does), a query
_ACROSS = {torch.Tensor.copy_, torch.Tensor.data.__set__, torch.Tensor.__setitem__,
           torch._has_compatible_shallow_copy_type}


def _tensors(tree):
    """The tensors in args, kwargs or results (tensors in tuples, lists and dicts)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


def _storage_key(x):
    try:
        return x.untyped_storage().data_ptr() or None  # an empty tensor has no storage to place
    except (RuntimeError, NotImplementedError):
        return None


def _place_of_device(device):
    if device is None:
        return None
    return CUDA if isinstance(device, int) else torch.device(device).type


class CudaStandIn(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        # storage data_ptr -> (CUDA or CPU, the storage: kept, so that no other storage gets its address)
        self._places = {}

    def place(self, x):
        """CUDA or CPU where the stand-in placed tensor x, else None."""
        key = _storage_key(x)
        return self._places[key][0] if key in self._places else None

    def _put(self, tensors, place):
        for x in tensors:
            key = _storage_key(x)
            if key and place and key not in self._places:
                self._places[key] = (place, x.untyped_storage())

    def placed_like(self, inputs, outputs):
        """outputs (a tensor, or tensors in tuples, lists, dicts) placed where inputs are, as an op would."""
        self._put(_tensors(outputs), self._place_of(list(_tensors(inputs))))
        return outputs

    def _place_of(self, tensors):
        places = {self.place(x) for x in tensors}
        return CUDA if CUDA in places else CPU if CPU in places else None

    def _check_one_device(self, func, args, tensors):
        if func in _ACROSS or not any(self.place(x) == CUDA for x in tensors):
            return
        on_cpu = [x for x in tensors if self.place(x) == CPU and x.dim() > 0]  # CUDA takes CPU scalars
        if on_cpu and not (func == torch.Tensor.__getitem__ and self.place(args[0]) == CUDA):  # CPU indices
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:0 and cpu! (in {getattr(func, '__name__', func)}, on the CPU stand-in of CUDA)")

    def _move(self, func, args, kwargs):
        """.to, .cuda or .cpu: a copy where the tensor changes place, as on CUDA."""
        x = args[0]
        target, dtype, copy = CUDA if func == torch.Tensor.cuda else CPU, None, False
        if func == torch.Tensor.to:
            other = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else kwargs.get("other")
            if other is not None:
                target, dtype = self.place(other) or CPU, other.dtype
            else:
                device, dtype = torch._C._nn._parse_to(*args[1:], **kwargs)[:2]
                target = _place_of_device(device)
            copy = kwargs.get("copy", False)
        here = self.place(x)
        moves = target is not None and target != (here or CPU)
        result = x.to(dtype=dtype or x.dtype, copy=copy or moves)
        self._put([result], target if moves else here)
        return result

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == torch.Tensor.device.__get__:
            return STAND_IN_DEVICE if self.place(args[0]) == CUDA else func(*args)
        if func == torch.Tensor.is_cuda.__get__:
            return self.place(args[0]) == CUDA
        if func == torch.Tensor.is_cpu.__get__:
            return self.place(args[0]) != CUDA
        if func == torch.Tensor.get_device:
            return 0 if self.place(args[0]) == CUDA else -1
        if func == torch.Tensor.numpy and self.place(args[0]) == CUDA:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first. (on the CPU stand-in of CUDA)")
        if func in _MOVES:
            return self._move(func, args, kwargs)
        inputs = list(_tensors((args, kwargs)))
        self._check_one_device(func, args, inputs)
        target = _place_of_device(kwargs.get("device"))
        if target == CUDA:
            generator = kwargs.get("generator")
            if generator is not None and generator.device.type == CPU:
                raise RuntimeError("Expected a 'cuda' device type for generator but found 'cpu' "
                                   "(on the CPU stand-in of CUDA)")
            kwargs["device"] = CPU
        result = func(*args, **kwargs)
        # a new tensor lives where it was made for, else where its inputs are; a factory's default is the CPU
        self._put(_tensors(result), target or (self._place_of(inputs) if inputs else CPU))
        return result


class StandInExtension:
    """The csrc extension as the stand-in sees it: its CPU twin (what it runs on CPU tensors) for its CUDA
    kernels, which it says it has, with its outputs placed where its inputs are."""

    def __init__(self, extension, mode):
        self._extension, self._mode = extension, mode

    def has_cuda_kernels(self):
        return True

    def __getattr__(self, name):
        value = getattr(self._extension, name)
        if not callable(value):
            return value
        return lambda *args: self._mode.placed_like(args, value(*args))


def fla_computed_by_chunked(chunked, fla_kernel):
    """fla's kernel of a rule as the stand-in runs it: fla's refusals (its kernel's unfit_reason), the chunked
    form's arithmetic on the inputs widened to the accumulation dtype (fla accumulates in float32), the output
    in the inputs' dtype and the state in the accumulation dtype (as fla returns them)."""
    def wide(call, *inputs):
        return [None if x is None else x.to(call.accumulation_dtype) for x in inputs]

    def sequence(call, q, k, v, beta, state, log_decay):
        out, W = chunked.sequence(call, *wide(call, q, k, v, beta), state, log_decay)
        return out.to(q.dtype), W

    def final_state(call, k, v, beta, state, log_decay):
        return chunked.final_state(call, *wide(call, k, v, beta), state, log_decay)

    def step_(call, memory, q, k, v, beta, log_decay):
        return chunked.step_(call, memory, *wide(call, q, k, v, beta), log_decay).to(q.dtype)

    return Kernel(sequence, final_state, step_, fla_kernel.unfit_reason)


@contextlib.contextmanager
def cuda_stood_in_for(monkeypatch):
    """CudaStandIn open, the kernels that the GPU tests run computed on the CPU: the csrc extension's CPU twin
    for its CUDA kernels (with an H100's shared memory), each rule's chunked form for fla's kernels (fla's own
    kernels through Triton's interpreter take seconds a call: tests/test_fla_interpreted.py tests them)."""
    from fairseq_fwp.ops import cuda as kernels
    from fairseq_fwp.ops.rules import UPDATE_RULES

    mode = CudaStandIn()
    monkeypatch.setattr(kernels, "_extension", StandInExtension(kernels.load_extension(), mode))
    monkeypatch.setattr(kernels, "device_shared_memory_limit", lambda device: H100_SHARED_MEMORY)
    for rule in UPDATE_RULES.values():
        if "fla" in rule.kernels:
            monkeypatch.setitem(rule.kernels, "fla", fla_computed_by_chunked(rule.kernels["chunked"],
                                                                             rule.kernels["fla"]))
    with mode:
        yield mode


def on_gpu_and_stand_in(names, on_gpu, on_stand_in):
    """Parametrize a GPU test: its `gpu` fixture (conftest.py: where it runs) and `names` (as pytest's parametrize
    takes them), each case of on_gpu on a GPU and each of on_stand_in on the CPU's stand-in (a few small ones:
    the test's own code is the same for all)."""
    cases = [("cuda", *case) for case in on_gpu] + [("stand-in", *case) for case in on_stand_in]
    return pytest.mark.parametrize(f"gpu, {names}", cases, indirect=["gpu"],
                                   ids=["-".join(map(_id, case)) for case in cases])


def _id(value):
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, list):  # command-line flags
        return ",".join(value)
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)
