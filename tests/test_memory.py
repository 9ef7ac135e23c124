"""stages/runtime/memory.py's free_tensors_reached: what train uses to give back the memory of an engine
that outlives its destroy() (a ZeRO-3 engine; the engine itself: tests/test_grad_norm.py)."""

import torch

from stages.runtime.memory import free_tensors_reached


class Holder:
    pass


def test_the_tensors_an_object_reaches_are_freed_and_no_others():
    outside = torch.ones(1000)
    root = Holder()
    root.me = root  # a cycle, as an engine's hooks make
    param = torch.nn.Parameter(torch.ones(100))
    param.ds_tensor = torch.ones(50)  # ZeRO-3's partition: an attribute of the parameter
    param.grad = torch.ones(100)
    root.groups = [{"params": [param]}]
    root.state = {param: {"exp_avg": torch.ones(10)}}
    root.view = root.state[param]["exp_avg"][:5]  # a view of a tensor it reaches: one storage, counted once
    root.hook = lambda: outside  # functions are not followed (their globals reach the whole program)
    freed = free_tensors_reached(root, torch.device("cpu"))
    assert freed == (100 + 50 + 100 + 10) * 4
    for t in (param, param.ds_tensor, param.grad, root.state[param]["exp_avg"]):
        assert t.untyped_storage().nbytes() == 0
    assert outside.sum().item() == 1000


def test_tensors_on_other_devices_are_left_alone():
    root = Holder()
    root.t = torch.ones(10)
    assert free_tensors_reached(root, torch.device("cuda", 0)) == 0
    assert root.t.sum().item() == 10


def test_memory_the_process_does_not_own_is_left_alone():
    import numpy as np

    root = Holder()
    array = np.ones(10, dtype=np.float32)
    root.borrowed = torch.from_numpy(array)  # numpy's memory: torch cannot resize it
    root.own = torch.ones(10)
    assert free_tensors_reached(root, torch.device("cpu")) == 40
    assert array.sum() == 10 and root.borrowed.sum().item() == 10
