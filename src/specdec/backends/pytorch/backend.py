"""ModelBackend for transformers/PyTorch causal LMs: eager with a position-pointer KV cache, or static (fixed buffers, CUDA graphs)."""

from __future__ import annotations

import inspect
import time
from typing import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from specdec.backends.base import BatchRows, ModelBackend, check_batch, forward_each, forward_rows
from specdec.backends.kvcache import PreallocatedKV
from specdec.backends.pytorch.batched_cache import BatchedView
from specdec.backends.pytorch.static_decoder import DEFAULT_BUCKETS, StaticDecoder, static_support


class _PointerLayer(DynamicLayer):
    """A transformers cache layer backed by PreallocatedKV: update writes in place, crop moves the pointer."""

    def __init__(self, capacity: int):
        super().__init__()
        self.store = PreallocatedKV(capacity)

    def lazy_initialization(self, key_states, value_states, *args, **kwargs) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.store.append(key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.store.length

    def get_max_length(self) -> int:
        return self.store.capacity

    def crop(self, tokens_to_remove: int) -> None:
        # transformers passes a negative count, or (legacy) the absolute length to keep.
        if tokens_to_remove < 0:
            self.store.trim(-tokens_to_remove)
        else:
            self.store.trim(self.store.length - tokens_to_remove)

    def reset(self) -> None:
        self.store.length = 0


class PointerCache(Cache):
    """A transformers Cache whose rollback is O(1): trim(n) moves every layer's position pointer back."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[_PointerLayer(capacity) for _ in range(num_layers)])
        self._capacity = capacity

    @property
    def length(self) -> int:
        return self.layers[0].store.length

    @property
    def capacity(self) -> int:
        return self._capacity

    def trim(self, n: int) -> int:
        dropped = 0
        for layer in self.layers:
            dropped = layer.store.trim(n)
        return dropped


class TransformersBackend(ModelBackend):
    """Wraps a loaded transformers causal LM (already in its weight format) behind ModelBackend.

    static: run the static decoder (backends/static_decoder.py: fixed KV buffers, row buckets, CUDA
    graphs on a GPU) instead of transformers' own forward. None (the default) chooses it when the model
    is on CUDA and of a supported architecture; True insists (ValueError if unsupported); False never.
    On CPU the eager path stays the default: there the tuned per-row kernels of the weight formats matter
    more than launches.
    """

    def __init__(self, model, tokenizer=None, name: str = "model", max_context: int | None = None,
                 static: bool | None = None, buckets=DEFAULT_BUCKETS, cuda_graphs: bool | None = None,
                 pad_to_buckets: bool | None = None, compile_layers: bool | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = int(text_config.num_hidden_layers)
        head = model.get_output_embeddings()
        self.vocab_size = int(getattr(head, "out_features", None) or text_config.vocab_size)
        # Ids this model can read (its embedding rows); a draft must be able to read every id the target emits.
        self.num_embeddings = int(model.get_input_embeddings().num_embeddings)
        model_limit = int(getattr(text_config, "max_position_embeddings", 0) or 0) or 1 << 20
        self.max_context = min(max_context or model_limit, model_limit)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self.forward_calls = 0
        self.forward_seconds = 0.0
        if static is None:
            static = self.device.type == "cuda" and static_support(model) is None
        self.decoder = StaticDecoder(model, self.max_context, buckets, cuda_graphs, pad_to_buckets,
                                     compile_layers) if static else None
        self.pass_costs: dict[int, float] | None = None  # measured by SpeculativeEngine.calibrate
        # On CUDA graphs a calibration takes well under a second, and the cost curve is nothing like a line.
        self.calibrate_on_first_use = self.decoder is not None and self.decoder.use_graphs

    @property
    def runtime(self) -> str:
        """What runs a forward, for reports."""
        if self.decoder is not None:
            return f"torch {self.device.type}, {self.decoder.description}"
        return f"torch {self.device.type}, eager transformers forward"

    def new_cache(self, capacity: int | None = None):
        capacity = capacity or self.max_context
        if self.decoder is not None:
            return self.decoder.new_cache(capacity)
        return PointerCache(self.num_layers, capacity)

    def synchronize(self) -> None:
        """Wait for the device's queued work (timing an asynchronous GPU needs it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], cache: PointerCache, num_logits: int = 1) -> torch.Tensor:
        """Append tokens to cache; return float logits [num_logits, vocab] for the last positions."""
        num_logits = forward_rows(tokens, cache, num_logits, self.name)
        n, start = len(tokens), cache.length
        began = time.perf_counter()
        if self.decoder is not None:
            try:
                logits = self.decoder.forward(tokens, cache, num_logits)
            except BaseException:
                cache.length = start  # rows a failed pass wrote lie past the length: nothing else to undo
                raise
            self.forward_calls += 1
            self.forward_seconds += time.perf_counter() - began
            return logits
        input_ids = torch.as_tensor([list(tokens)], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + n, device=self.device).unsqueeze(0)
        kwargs = {self._cache_kwarg: cache, "position_ids": positions, "use_cache": True}
        if self._has_logits_to_keep:
            kwargs["logits_to_keep"] = num_logits
        try:
            out = self.model(input_ids=input_ids, **kwargs)
        except BaseException:
            # A failed forward may have written some layers; put every layer back where it was.
            for layer in cache.layers:
                layer.store.length = start
            raise
        logits = out.logits[0, -num_logits:].float()
        self.forward_calls += 1
        self.forward_seconds += time.perf_counter() - began
        return logits

    @torch.inference_mode()
    def forward_batch(self, batch: Sequence[BatchRows]) -> list[torch.Tensor]:
        """backends.base.forward_batch's contract in one transformers forward over all entries.

        Each entry's tokens are left-padded to the longest entry's, so every entry's last rows are the pass's
        last rows; a BatchedView writes each entry's rows into its own cache and hands attention each
        sequence's history zero-padded to a common width, under a mask that keeps each row to its own
        sequence's keys. Logits match a solo forward to float rounding (padding changes the sums' shapes),
        not bit for bit. With the static decoder, a model whose attention is not eager/sdpa or not full
        causal everywhere (sliding windows), or a batch of one, each entry runs its own forward (forward_each).
        """
        batch = list(batch)
        wanted = check_batch(batch, self.name,
                             lambda cache: self.decoder is not None or isinstance(cache, PointerCache))
        if len(batch) < 2 or self.decoder is not None or not _batchable(self.model):
            return forward_each(self, batch)
        counts = [len(rows.tokens) for rows in batch]
        keep = max(max(1, n) for n in wanted)
        width = max(counts)
        began = time.perf_counter()
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for i, rows in enumerate(batch):
            ids[i, width - counts[i]:] = torch.as_tensor(list(rows.tokens), dtype=torch.long)
        view = BatchedView([rows.cache for rows in batch], counts)
        eager = self.model.config._attn_implementation == "eager"
        mask_dtype = self.model.get_input_embeddings().weight.dtype if eager else None
        kwargs = {self._cache_kwarg: view, "position_ids": view.positions(self.device), "use_cache": True,
                  "attention_mask": view.attention_mask(mask_dtype, self.device)}
        if self._has_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        try:
            out = self.model(input_ids=ids.to(self.device), **kwargs)
        except BaseException:
            view.restore()  # a failed pass may have written some layers of some caches
            raise
        logits = out.logits[:, -keep:].float()
        self.forward_calls += 1
        self.forward_seconds += time.perf_counter() - began
        # Entry i's last min(num_logits, rows) rows are the last rows of its line (left padding).
        return [logits[i, keep - n:] if n else logits[i, :0] for i, n in enumerate(wanted)]


def _batchable(model) -> bool:
    """Whether the batched pass's ready-made full-causal mask is the mask this model would build itself: eager or
    sdpa attention (they take a 4-D mask as given), and no sliding-window or other non-full layers."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "_attn_implementation", None) not in ("eager", "sdpa"):
        return False
    if getattr(text, "sliding_window", None) is not None or getattr(text, "attention_chunk_size", None):
        return False
    return all(t == "full_attention" for t in (getattr(text, "layer_types", None) or ["full_attention"]))


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value if v is not None)
    return frozenset(ids)
