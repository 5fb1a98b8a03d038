"""A counter of tensor-to-host reads (no tests here): on a GPU every such read is a sync that idles the device."""

import collections

from torch.overrides import TorchFunctionMode

HOST_READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "numpy"}


class HostReads(TorchFunctionMode):
    """Counts tensor -> Python reads made under it."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))
