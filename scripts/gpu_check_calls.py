"""The calls that reach fla's kernels, one record per distinct call: made from a call as it happens, written
to and read from JSON, and replayed.

scripts/gpu_check_plan.py records the calls each part of the GPU check makes (on the CPU) and writes them;
the check's compile part replays them on the GPU, several processes at once, each autotuning its shard of
every kernel's configs, so that Triton compiles and times every config the parts would, spread over the
machine's cores, before they run (and the check records the winners).

    python scripts/gpu_check_calls.py FILE PARTS PROCESS/PROCESSES    (what the compile part runs)
"""
import contextlib
import dataclasses
import hashlib
import json
import types

import torch

INPUTS = ("q", "k", "v", "beta", "state", "log_decay")
FORMS = ("sequence", "final_state", "step")


@dataclasses.dataclass(frozen=True)
class FlaCall:
    """A call of an update rule's fla kernel: its form (FORMS), each of INPUTS as None or (shape, dtype,
    requires_grad), and the dtype the call computes in (backends.Call.dtype)."""

    rule: str
    form: str
    inputs: tuple
    dtype: str
    needs_grad: bool

    @classmethod
    def of(cls, form, call, tensors):
        """The record of `call` (a backends.Call) with `tensors` (INPUTS, in order; None where absent)."""
        inputs = tuple(None if x is None else (tuple(x.shape), str(x.dtype).removeprefix("torch."), x.requires_grad)
                       for x in tensors)
        return cls(call.rule.name, form, inputs, str(call.dtype).removeprefix("torch."), call.needs_grad)

    def with_batch(self, batch):
        """The same call with `batch` rows (the first dimension of every input)."""
        return dataclasses.replace(self, inputs=tuple(None if x is None else ((batch, *x[0][1:]), *x[1:])
                                                      for x in self.inputs))

    def with_dtype(self, dtype, as_dtype):
        """The same call with `as_dtype` wherever it has `dtype` (names: "bfloat16", "float16")."""
        swap = lambda name: as_dtype if name == dtype else name  # noqa: E731
        return dataclasses.replace(self, dtype=swap(self.dtype), inputs=tuple(
            None if x is None else (x[0], swap(x[1]), x[2]) for x in self.inputs))

    def to_json(self):
        return {"rule": self.rule, "form": self.form, "dtype": self.dtype, "needs_grad": self.needs_grad,
                "inputs": {name: None if x is None else list(x) for name, x in zip(INPUTS, self.inputs)}}

    @classmethod
    def from_json(cls, data):
        inputs = tuple(None if data["inputs"][name] is None else
                       (tuple(data["inputs"][name][0]), *data["inputs"][name][1:]) for name in INPUTS)
        return cls(data["rule"], data["form"], inputs, data["dtype"], data["needs_grad"])

    def describe(self):
        q = self.inputs[0][0]
        return (f"{self.rule} {self.form}, {self.dtype}, q {'x'.join(map(str, q))}"
                f"{', with gradients' if self.needs_grad else ''}{', from a state' if self.inputs[4] else ''}")

    def replay(self, kernel, device):
        """Runs the call through `kernel` (a protocol.Kernel: the rule's fla kernel) on `device` with random
        inputs of the recorded shapes and dtypes, its backward too where it needs gradients."""
        from fairseq_fwp.ops.backends import Call
        from fairseq_fwp.ops.rules import update_rule

        tensors = [None if x is None else torch.rand(x[0], dtype=getattr(torch, x[1]), device=device) * 0.5 + 0.25
                   for x in self.inputs]
        tensors = [None if x is None else x.requires_grad_(spec[2]) for x, spec in zip(tensors, self.inputs)]
        q, k, v, beta, state, log_decay = tensors
        if log_decay is not None:
            log_decay = log_decay.detach().neg().requires_grad_(self.inputs[5][2])  # a decay in (0, 1)
        step = self.form == "step"
        call = Call(rule=update_rule(self.rule), dtype=getattr(torch, self.dtype), device=torch.device(device),
                    D=q.shape[-1], Dv=v.shape[-1], T=1 if step else q.shape[2], needs_grad=self.needs_grad,
                    step=step)
        with torch.set_grad_enabled(self.needs_grad):
            if self.form == "sequence":
                outputs = kernel.sequence(call, q, k, v, beta, state, log_decay)
            elif self.form == "final_state":
                outputs = (kernel.final_state(call, k, v, beta, state, log_decay),)
            else:
                W = torch.zeros(*q.shape[:2], v.shape[-1], q.shape[-1], dtype=call.accumulation_dtype, device=device)
                memory = types.SimpleNamespace(fast_weight_for=lambda *args, **kwargs: W)
                outputs = (kernel.step_(call, memory, q, k, v, beta, log_decay),)
            grown = [x for x in outputs if isinstance(x, torch.Tensor) and x.requires_grad]
            if grown:
                torch.autograd.backward(grown, [torch.ones_like(x) for x in grown])


def write(path, calls_by_part):
    """calls_by_part: {part: [(FlaCall, kernels it compiles alone on a cold machine)]} into `path` (JSON: each
    call's record, with "compiles")."""
    line = lambda call, compiles: "  " + json.dumps({**call.to_json(), "compiles": compiles}, sort_keys=True)  # noqa
    parts = [f"{json.dumps(part)}: [\n" + ",\n".join(line(*c) for c in calls) + "\n ]"
             for part, calls in calls_by_part.items()]
    with open(path, "w") as f:  # a call a line: a change to the plan reads as the calls it changes
        f.write("{\n " + ",\n ".join(parts) + "\n}\n")


def distinct(planned):
    """The distinct calls of {part: [a call as written]}, in the parts' order (as written)."""
    seen, calls = set(), []
    for part_calls in planned.values():
        for call in part_calls:
            key = json.dumps(FlaCall.from_json(call).to_json(), sort_keys=True)
            if key not in seen:
                seen.add(key)
                calls.append(call)
    return calls


def shard(configs, kernel, key, process, processes):
    """The configs of `kernel`'s autotuning for `key` that process `process` of `processes` times: each config in
    one process, two or more a process (Triton times a list of one not at all, and records nothing), spread
    over the processes by the kernel and key; [] where the process has none."""
    shards = max(1, min(processes, len(configs) // 2))
    first = int(hashlib.md5(f"{kernel}{key}".encode()).hexdigest(), 16) % processes
    mine = (process - first) % processes
    return configs[mine::shards] if mine < shards else []


@contextlib.contextmanager
def sharded_autotuning(process, processes):
    """While open, each autotuned kernel times only this process's shard of its configs for a key (shard),
    and is not run at all where the process has none (the kernels after it read whatever memory holds: their
    autotuning times them as well); a key whose config fla already knows (fla_configs.preload) runs in one
    process. Triton's cache keeps every shard's timings, and fla_configs.record takes the fastest."""
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.run

    def run(tuner, *args, **kwargs):
        named = {k: v for k, v in {**dict(zip(tuner.arg_names, args)), **kwargs}.items() if k in tuner.arg_names}
        key = tuple([named[k] for k in tuner.keys if k in named] +
                    [str(v.dtype) for v in named.values() if hasattr(v, "dtype")])
        configs = [tuner.cache[key]] if key in tuner.cache else tuner.configs
        mine = shard(configs, tuner.base_fn.__name__, key, process, processes)
        if not mine:
            return None
        saved, tuner.configs = tuner.configs, mine
        try:
            return original(tuner, *args, **kwargs)
        finally:
            tuner.configs = saved

    Autotuner.run = run
    try:
        yield
    finally:
        Autotuner.run = original


def main(argv):
    """FILE PARTS PROCESS/PROCESSES: replays on the GPU every distinct call of PARTS in FILE through each rule's
    fla kernel, autotuning this process's shard of each kernel's configs; one line a call: its seconds."""
    import time

    from fairseq_fwp.ops.rules import update_rule

    path, parts, which = argv
    process, processes = map(int, which.split("/"))
    with open(path) as f:
        planned = json.load(f)
    with sharded_autotuning(process, processes):
        for data in distinct({part: planned[part] for part in parts.split(",") if part in planned}):
            call, start = FlaCall.from_json(data), time.time()
            call.replay(update_rule(call.rule).kernels["fla"], "cuda")
            torch.cuda.synchronize()
            print(f"{call.describe()}: {time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:])
