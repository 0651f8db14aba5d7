"""Counting what would make a decoding step wait for the GPU, on any device (a CPU too).

On CUDA the host queues kernels ahead of the device until something needs a value back (``.item()``,
``.tolist()``, ``bool(t)``, indexing with a 0-dim or boolean tensor, ``nonzero``) or sends one over from Python
data (``torch.tensor(list)`` on the device, ``t[i] = 5``): each such call stalls the queue. A speculative step
needs one read, the accepted path; the others can stay on the device. :class:`HostSyncs` counts them with a
``TorchFunctionMode``, so the tests pin each method's count on a CPU and a regression fails CI;
``torch.cuda.set_sync_debug_mode`` gives the device's own count in ``make gpu-check``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_READS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
          torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.__index__: "index",
          torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy", torch.Tensor.nonzero: "nonzero",
          torch.nonzero: "nonzero", torch.masked_select: "masked_select", torch.Tensor.masked_select: "masked_select"}
_WRITES = {torch.tensor: "tensor(data)", torch.as_tensor: "as_tensor(data)", torch.Tensor.new_tensor: "new_tensor"}
_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


def _host_index(index: Any) -> bool:
    """An index whose result size or position needs a device value on the host: a 0-dim or boolean tensor."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and (i.dim() == 0 or i.dtype == torch.bool) for i in parts)


class HostSyncs(TorchFunctionMode):
    """Counts host reads and writes while active and ``counting``; ``events`` names each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = True
        self.events: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.events.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counting:
            if func in _READS:
                self.events[_READS[func]] += 1
            elif func in _WRITES and not isinstance(args[0] if args else kwargs.get("data"), torch.Tensor):
                self.events[_WRITES[func]] += 1
            elif func in _INDEXING and _host_index(args[1]):
                self.events["indexing with a 0-dim or boolean tensor"] += 1
            elif func is torch.Tensor.__setitem__ and isinstance(args[2], (int, float, bool)):
                self.events["setitem(python number)"] += 1
        return func(*args, **kwargs)
