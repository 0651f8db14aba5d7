"""The KV cache the engine verifies into: every layer's keys and values in one preallocated tensor.

transformers' ``DynamicCache`` grows each layer by concatenation, so every step copies the whole cache of every
layer, and keeping an accepted path that is not contiguous costs two indexing copies per layer. Here the cache of
all layers is one tensor ``[layers, 2, batch, kv heads, capacity, head dim]``: a step writes its block in place,
dropping entries is setting a length, and moving an accepted path into place is one gather and one copy for all
layers at once, whatever their number. Each layer of the model sees a view of its own slice (a
:class:`SlabLayer`, through transformers' own ``Cache`` interface: nothing of transformers is patched).

Every layer keeps the whole prefix (sliding-window layers too): the engine masks what a window hides, so an
accepted path can always be gathered into place.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _Slab:
    """The one tensor behind every layer, allocated on the first layer's first update, grown when a block needs it."""

    def __init__(self, layers: int, capacity: int, batch: int = 1):
        self.layers, self.capacity, self.batch = layers, capacity, batch
        self.data: torch.Tensor | None = None  # [layers, 2, batch, heads, capacity, head_dim]
        self.length = 0  # positions held (the same for every layer between forwards)

    def ensure(self, like: torch.Tensor, end: int) -> torch.Tensor:
        """The tensor, with room for ``end`` positions of entries shaped like ``like`` ([batch, heads, q, dim])."""
        batch, heads, _, dim = like.shape
        if self.data is not None and self.data.shape[2:4] + self.data.shape[5:] != (batch, heads, dim):
            raise NotImplementedError(f"a KV entry of shape {tuple(like.shape)} after {tuple(self.data.shape)}: "
                                      "draftbench's cache needs the same heads and head size in every layer")
        if self.data is None or end > self.data.shape[4]:
            capacity = max(end, self.capacity, 2 * (self.data.shape[4] if self.data is not None else 0))
            grown = like.new_zeros(self.layers, 2, batch, heads, capacity, dim)
            if self.data is not None:
                grown[:, :, :, :, : self.length] = self.data[:, :, :, :, : self.length]
            self.data = grown
        return self.data


class SlabLayer(CacheLayerMixin):
    """One model layer's view of the slab, as transformers' attention calls it."""

    is_sliding = False
    is_croppable = True

    def __init__(self, slab: _Slab, index: int):
        super().__init__()
        self.slab, self.index = slab, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.slab.length
        end = start + key_states.shape[-2]
        own = self.slab.ensure(key_states, end)[self.index]
        own[0, :, :, start:end] = key_states
        own[1, :, :, start:end] = value_states
        self.keys, self.values = own[0, :, :, :end], own[1, :, :, :end]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slab.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.slab.length

    def get_max_length(self) -> int:
        return -1


class SlabCache(Cache):
    """A cache for ``layers`` decoder layers, room for ``capacity`` positions to begin with (it grows if needed)."""

    def __init__(self, layers: int, capacity: int):
        self.slab = _Slab(layers, capacity)
        super().__init__(layers=[SlabLayer(self.slab, i) for i in range(layers)])

    def __len__(self) -> int:
        return len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.slab.length

    def commit(self, length: int) -> None:
        """Keep the first ``length`` positions (after a forward wrote its block): the rest are dropped."""
        self.slab.length = length

    def keep(self, position: int, path: torch.Tensor) -> None:
        """Move the entries at ``position + path`` ([L] block indices, root first) to ``position ..`` for every layer
        at once, and drop the rest of the block."""
        end = position + len(path)
        data = self.slab.data
        data[:, :, :, :, position:end] = data.index_select(4, position + path)
        self.slab.length = end


class BatchLayer(SlabLayer):
    """One model layer's view of a batch slab: a forward over the first ``n`` rows writes and reads those rows."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, start = key_states.shape[0], self.slab.length
        end = start + key_states.shape[-2]
        own = self.slab.ensure(key_states[:1].expand(self.slab.batch, -1, -1, -1), end)[self.index]
        own[0, :rows, :, start:end] = key_states
        own[1, :rows, :, start:end] = value_states
        self.keys, self.values = own[0, :rows, :, :end], own[1, :rows, :, :end]
        return self.keys, self.values


class _RowSlab(_Slab):
    """Row ``row`` of a batch slab as a slab of one row: a prefill writes its prompt's entries in place."""

    def __init__(self, parent: _Slab, row: int):
        super().__init__(parent.layers, parent.capacity, 1)
        self.parent, self.row = parent, row

    def ensure(self, like: torch.Tensor, end: int) -> torch.Tensor:
        data = self.parent.ensure(like[:1].expand(self.parent.batch, -1, -1, -1), end)
        return data[:, :, self.row : self.row + 1]


class BatchCache(SlabCache):
    """The KV cache of a batch (methods.batch): one slab ``[layers, 2, batch, kv heads, capacity, head dim]``.

    Every row's valid entries are left-aligned, ``[0, L_b)``. A step writes every row's block at the same columns
    ``[C, C + q)`` with ``C = max L_b`` (the engine masks row b's columns ``[L_b, C)``), then :meth:`move` puts each
    row's accepted entries after its own prefix, all rows and layers in one gather and one scatter.
    """

    def __init__(self, layers: int, batch: int, capacity: int = 0):
        self.slab = _Slab(layers, capacity, batch)
        Cache.__init__(self, layers=[BatchLayer(self.slab, i) for i in range(layers)])

    def reserve(self, capacity: int) -> None:
        """Room for ``capacity`` positions in every row from the next allocation or growth on."""
        self.slab.capacity = max(self.slab.capacity, capacity)

    def row(self, index: int) -> SlabCache:
        """Row ``index`` as an empty one-row cache, for a prefill of that row alone (written in place)."""
        view = SlabCache.__new__(SlabCache)
        view.slab = _RowSlab(self.slab, index)
        Cache.__init__(view, layers=[SlabLayer(view.slab, i) for i in range(self.slab.layers)])
        return view

    def move(self, rows: torch.Tensor, to: torch.Tensor, source: torch.Tensor) -> None:
        """Entry ``source[i]`` of row ``rows[i]`` to column ``to[i]`` of the same row, for every layer ([N] each)."""
        data = self.slab.data
        data[:, :, rows, :, to] = data[:, :, rows, :, source]
