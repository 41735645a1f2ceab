"""Per-sequence PointerCaches as one transformers Cache for one batched forward over left-padded rows: each layer's
update appends sequence i's real rows to its own cache and returns every sequence's keys/values left-aligned at
0..length_i + rows_i - 1 and zero after; `attention_mask()` is the matching ready-made 4-D mask."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache


class _ViewLayer:
    """Layer `index` of every sequence's cache, as one transformers cache layer."""

    def __init__(self, view: "BatchedView", index: int):
        self.view = view
        self.index = index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        view = self.view
        batch, heads, rows, _ = key_states.shape
        keys = key_states.new_zeros(batch, heads, view.width, key_states.shape[-1])
        values = value_states.new_zeros(batch, heads, view.width, value_states.shape[-1])
        for i, (cache, n) in enumerate(zip(view.caches, view.counts)):
            # Rows are left-padded: sequence i's own rows are the last n of the pass. Its own cache layer
            # writes them at its own position and returns its whole history, which is copied into slot i.
            own_keys, own_values = cache.layers[self.index].update(
                key_states[i : i + 1, :, rows - n :], value_states[i : i + 1, :, rows - n :])
            end = own_keys.shape[-2]
            keys[i, :, :end] = own_keys[0]
            values[i, :, :end] = own_values[0]
        return keys, values

    # Nothing in the forward should ask for sizes (the mask is ready-made, positions are given); if something
    # does, it gets the padded layout this layer returns.
    def get_seq_length(self, *args, **kwargs) -> int:
        return self.view.width - self.view.rows

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.view.width, 0


class BatchedView(Cache):
    """The caches of one pass (each appearing once) with counts[i] new rows for caches[i]; query rows are
    left-padded to max(counts), so each sequence's last rows are the pass's last rows (one logits_to_keep)."""

    def __init__(self, caches: Sequence, counts: Sequence[int]):
        self.caches = list(caches)
        self.counts = [int(n) for n in counts]
        self.starts = [cache.length for cache in self.caches]
        self.rows = max(self.counts)
        self.width = max(s + n for s, n in zip(self.starts, self.counts))
        super().__init__(layers=[_ViewLayer(self, i) for i in range(len(self.caches[0].layers))])

    def restore(self) -> None:
        """Every layer of every cache back to its length before the pass (a failed pass may have written some)."""
        for cache, start in zip(self.caches, self.starts):
            for layer in cache.layers:
                layer.store.length = start

    def positions(self, device) -> torch.Tensor:
        """position_ids [batch, rows]: length_i + j for sequence i's row j; padding rows take length_i (unused)."""
        offsets = self._row_offsets(device)
        starts = torch.tensor(self.starts, device=device).unsqueeze(1)
        return starts + offsets.clamp_min(0)

    def attention_mask(self, dtype: torch.dtype | None, device) -> torch.Tensor:
        """[batch, 1, rows, width]: sequence i's row j sees its keys 0..length_i + j (causal over its own history,
        never another sequence's slot or the zero padding); a padding row sees key 0 only, so its softmax is
        finite. Bool (True = attend) for sdpa when dtype is None, else additive (0 / dtype's min) for eager."""
        last = torch.tensor(self.starts, device=device).unsqueeze(1) + self._row_offsets(device)
        keys = torch.arange(self.width, device=device)
        visible = keys.view(1, 1, -1) <= last.clamp_min(0).unsqueeze(-1)
        visible = visible.unsqueeze(1)
        if dtype is None:
            return visible
        return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)

    def _row_offsets(self, device) -> torch.Tensor:
        """[batch, rows]: j for sequence i's j-th own row, negative for its padding rows in front."""
        counts = torch.tensor(self.counts, device=device).unsqueeze(1)
        return torch.arange(self.rows, device=device).unsqueeze(0) - (self.rows - counts)
