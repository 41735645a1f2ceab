"""Static-shape decoding of Llama-family transformers models: a fixed KV buffer, row-count buckets, and on CUDA one captured graph per bucket.

Why: on a GPU an eager transformers forward is bound by Python and kernel launches (15-28 ms a pass
on an H200 whatever the model size). A forward whose shapes and buffers never change can be captured
once as a CUDA graph and replayed for ~the cost of its kernels. Everything a pass reads or writes
therefore lives in fixed buffers:

- the KV cache is one [2 x kv_heads, slots, head_dim] tensor per layer (keys, then values), written
  at the rows' positions with one index_copy_ (no views that grow each token, no allocation);
- a pass of n rows runs in the smallest bucket >= n (1, 2, 4, ..., 128); padding rows sit after the real
  ones, at later positions, so the causal mask keeps them out of every real row's attention, and what
  they write lands past the cache's length, where the next pass overwrites it;
- attention runs over all slots with an additive mask built on the device from the positions, so the
  same graph serves every cache length.

The math is the model's own (its weights, its rotary table, its norms' epsilon), rewritten with fewer
kernels: q/k/v and gate/up are one matrix product each (the modules' parameters become views into the
fused tensors, so no weight is stored twice), rotary embedding is three kernels, and grouped-query
attention folds the query heads that share a KV head into rows instead of copying the cache.

On CPU the same code runs eagerly (no graphs; padding only when asked for): that is how the tests
check it against the model's own forward.
"""

from __future__ import annotations

import sys
import time
import types
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdec.backends.kvcache import ContextOverflowError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_SLOT_ALIGN = 64  # memory-efficient attention wants the mask's row stride aligned


def static_support(model) -> str | None:
    """None when `model` can run on the static path, else why not (the caller falls back to eager transformers)."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(text_config, "hidden_act", "silu") != "silu":
        return f"activation {text_config.hidden_act!r} is not silu"
    layer_types = getattr(text_config, "layer_types", None) or ()
    if any("sliding" in str(kind) for kind in layer_types) or (
            model_type == "mistral" and getattr(text_config, "sliding_window", None) is not None):
        return "sliding-window attention is not supported"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "rotary_emb", None) is None or getattr(model, "lm_head", None) is None:
        return "the model does not have the Llama layout (model.layers, model.rotary_emb, lm_head)"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention is not supported"
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(m) is not nn.Linear for m in linears) or type(model.lm_head) is not nn.Linear:
            return "its linear layers are not plain nn.Linear (an int8 or packed weight format)"
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type == "dynamic":
        return "dynamic RoPE scaling depends on the sequence length"
    return None


@dataclass
class _LayerWeights:
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    out: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    norm_attn: torch.Tensor
    norm_mlp: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def _fuse(modules: Sequence[nn.Linear], attr: str) -> torch.Tensor | None:
    """Concatenate the modules' `attr` along dim 0 and make each module's parameter a view into the result."""
    parts = [getattr(m, attr) for m in modules]
    if any(p is None for p in parts):
        if all(p is None for p in parts):
            return None
        parts = [p if p is not None else torch.zeros(m.out_features, dtype=modules[0].weight.dtype,
                                                        device=modules[0].weight.device)
                 for p, m in zip(parts, modules)]
    fused = torch.cat([p.detach() for p in parts], dim=0)
    offset = 0
    for module, part in zip(modules, parts):
        rows = part.shape[0]
        if getattr(module, attr) is not None:
            setattr(module, attr, nn.Parameter(fused[offset : offset + rows], requires_grad=False))
        offset += rows
    return fused


def _norm_eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class StaticKVCache:
    """A KVCache over fixed buffers; `length` tokens are valid, rollback only moves the pointer.

    kv[l]: [2 * kv_heads, slots, head_dim], layer l's keys then its values (one write per layer and
    pass; _layer attends to its two halves). slots >= capacity + the largest bucket, so the
    padding rows of a pass never write out of range. Graphs captured for this cache live here too:
    they hold the buffers' addresses.
    """

    def __init__(self, decoder: "StaticDecoder", capacity: int):
        if capacity + decoder.max_bucket > decoder.max_slots:
            raise ContextOverflowError(
                f"a static cache of {capacity} tokens needs {capacity + decoder.max_bucket} positions; "
                f"the decoder was built for {decoder.max_slots}"
            )
        self._capacity = capacity
        self.length = 0
        self.slots = decoder.max_slots
        shape = (2 * decoder.num_kv_heads, self.slots, decoder.head_dim)
        with torch.inference_mode():
            self.kv = [torch.zeros(shape, dtype=decoder.dtype, device=decoder.device) for _ in range(decoder.num_layers)]
            # Row r of a pass: (token id, position). One host->device copy per pass fills it.
            self.inputs = torch.zeros(decoder.max_bucket, 2, dtype=torch.long, device=decoder.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # The cache's graphs share one memory pool, which lives and dies with them: a pool id whose graphs
        # were all freed must not be captured into again (PyTorch's allocator asserts).
        self.pool = torch.cuda.graph_pool_handle() if decoder.use_graphs else None

    @property
    def capacity(self) -> int:
        return self._capacity

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.length))
        self.length -= n
        return n


class StaticDecoder:
    """The static forward of one Llama-family model; see the module docstring.

    max_positions: the largest cache capacity any new_cache() may ask for.
    buckets:       row counts a pass is padded to on the graph path (the largest is also the prefill chunk).
    use_graphs:    capture CUDA graphs (default: when the model is on CUDA).
    pad:           pad passes to buckets and chunk prefill (default: with graphs; tests turn it on for CPU).
    compile_layers: run each layer through torch.compile (default: with graphs). A failed
                   compile falls back to the eager layers, with a message.
    """

    def __init__(self, model, max_positions: int, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 use_graphs: bool | None = None, pad: bool | None = None, compile_layers: bool | None = None):
        reason = static_support(model)
        if reason is not None:
            raise ValueError(f"static decoding is not available: {reason}")
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive row counts, got {buckets}")
        self.max_bucket = self.buckets[-1]
        inner = model.model
        first = inner.layers[0].self_attn
        self.device = first.q_proj.weight.device
        self.dtype = first.q_proj.weight.dtype
        self.num_layers = len(inner.layers)
        self.head_dim = int(first.head_dim)
        self.num_heads = first.q_proj.out_features // self.head_dim
        self.num_kv_heads = first.k_proj.out_features // self.head_dim
        self.groups = self.num_heads // self.num_kv_heads
        self.scaling = float(first.scaling)
        self.hidden = inner.embed_tokens.embedding_dim
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.eps = _norm_eps(inner.norm)
        self.lm_head = model.lm_head.weight
        self.lm_head_bias = model.lm_head.bias
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_LayerWeights(
                qkv=_fuse([attn.q_proj, attn.k_proj, attn.v_proj], "weight"),
                qkv_bias=_fuse([attn.q_proj, attn.k_proj, attn.v_proj], "bias"),
                out=attn.o_proj.weight,
                gate_up=_fuse([mlp.gate_proj, mlp.up_proj], "weight"),
                down=mlp.down_proj.weight,
                norm_attn=layer.input_layernorm.weight,
                norm_mlp=layer.post_attention_layernorm.weight,
                q_norm=attn.q_norm.weight if getattr(attn, "q_norm", None) is not None else None,
                k_norm=attn.k_norm.weight if getattr(attn, "k_norm", None) is not None else None,
            ))
        self.qk_norm_eps = _norm_eps(inner.layers[0].self_attn.q_norm) if self.layers[0].q_norm is not None else 0.0
        # Slots: every position a cache of max_positions can hold plus one bucket of padding rows.
        self.max_slots = -(-(max_positions + self.max_bucket) // _SLOT_ALIGN) * _SLOT_ALIGN
        with torch.inference_mode():
            positions = torch.arange(self.max_slots, device=self.device)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, positions.unsqueeze(0))  # the model's own table, in its dtype
            half = self.head_dim // 2
            self.cos = cos[0].contiguous()
            # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated): exact, one kernel fewer.
            self.sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).contiguous()
            self.slot_index = positions
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.pad = self.use_graphs if pad is None else bool(pad)
        self.graph_failure: str | None = None  # why capture was given up, if it was
        self.compile_layers = self.use_graphs if compile_layers is None else bool(compile_layers)
        self.compile_failure: str | None = None  # why compiling was given up, if it was
        self.compile_seconds: float | None = None  # the first cache's compile of every bucket
        self._compiled_layer = None
        self._layer = _layer
        if self.compile_layers:
            self.set_layers_compiled(True)
        self.passes = {}  # bucket -> passes run, for reports

    @property
    def description(self) -> str:
        if self.compile_layers:
            layers = "compiled layers"
        else:
            layers = "eager layers" + (f" (compile failed: {self.compile_failure})" if self.compile_failure else "")
        if self.use_graphs:
            return f"static KV cache, {layers}, CUDA graphs per row bucket ({', '.join(map(str, self.buckets))})"
        suffix = f" (CUDA graphs off: {self.graph_failure})" if self.graph_failure else ""
        return f"static KV cache, {layers}, no graphs" + suffix

    def new_cache(self, capacity: int) -> StaticKVCache:
        """A cache with every bucket's graph captured up front: a capture (tens of ms) inside a timed step
        would teach the k policy that the step is slow."""
        cache = StaticKVCache(self, capacity)
        if self.compile_layers and self.compile_seconds is None:
            self._compile_every_bucket(cache)
        if self.use_graphs:
            with torch.inference_mode():
                for rows in self.buckets:
                    cache.inputs[:rows, 0] = 0
                    cache.inputs[:rows, 1] = torch.arange(rows, device=self.device)
                    try:
                        cache.graphs[rows] = self._capture(cache, rows)
                    except RuntimeError as exc:
                        self._give_up_graphs(exc)
                        break
        return cache

    def bucket_for(self, rows: int) -> int:
        for bucket in self.buckets:
            if bucket >= rows:
                return bucket
        return self.max_bucket

    # ----- the pass ---------------------------------------------------------------------------

    def forward(self, tokens: Sequence[int], cache: StaticKVCache, num_logits: int) -> torch.Tensor:
        """Append tokens at cache.length; return float32 logits [num_logits, vocab] of the last positions.

        Inputs longer than the largest bucket run in chunks of it (chunked prefill).
        """
        n = len(tokens)
        start = cache.length
        chunk = self.max_bucket  # the inputs buffer and the padding slots hold one bucket
        first_needed = n - num_logits
        outputs = []
        for lo in range(0, n, chunk):
            part = tokens[lo : lo + chunk]
            keep_from = max(first_needed - lo, 0)
            logits = self._pass(cache, part, start + lo, keep_from)
            if keep_from < len(part):
                outputs.append(logits)
            cache.length = start + lo + len(part)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _pass(self, cache: StaticKVCache, tokens: Sequence[int], start: int, keep_from: int) -> torch.Tensor:
        n = len(tokens)
        rows = self.bucket_for(n) if self.pad else n
        host = torch.empty(rows, 2, dtype=torch.long)
        host[:, 0] = 0
        host[:n, 0] = torch.as_tensor(tokens, dtype=torch.long)
        host[:, 1] = torch.arange(start, start + rows)
        cache.inputs[:rows].copy_(host)
        self.passes[rows] = self.passes.get(rows, 0) + 1
        if self.use_graphs:
            try:
                graph, out = cache.graphs[rows]  # captured with the cache (new_cache)
                graph.replay()
                # The graph's output is overwritten by its next replay: hand out a copy of the rows asked for.
                return out[keep_from:n].clone()
            except RuntimeError as exc:  # a replay this torch/driver refuses: keep decoding, eagerly
                self._give_up_graphs(exc)
                return self._pass(cache, tokens, start, keep_from)
        return self._compute(cache, rows, keep_from)[: n - keep_from]

    def set_layers_compiled(self, compiled: bool) -> None:
        """Run the compiled (True) or the eager (False) layer function in caches made from now on; the bench
        measures both. Graphs already captured keep the kernels they were captured with."""
        if compiled and self.compile_failure is None:
            if self._compiled_layer is None:
                self._compiled_layer = _compiled(_layer)
                self.compile_seconds = None
            self._layer = self._compiled_layer
            self.compile_layers = True
        else:
            self._layer = _layer
            self.compile_layers = False

    def _compile_every_bucket(self, cache: StaticKVCache) -> None:
        """Compile the layer function for every bucket's shapes now (seconds to minutes, once per decoder), so
        no compile lands in a capture or a timed pass; on any failure decode with the eager layer."""
        began = time.perf_counter()
        rows_list = self.buckets if self.pad else (1, 2)  # unpadded passes: the 1-row and the many-row variant
        try:
            with torch.inference_mode():
                for rows in rows_list:
                    cache.inputs[:rows, 0] = 0
                    cache.inputs[:rows, 1] = torch.arange(rows, device=self.device)
                    self._compute(cache, rows, 0)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # an inductor/triton that cannot build here: the eager layer does the same math
            self.compile_failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            self.set_layers_compiled(False)
            print(f"specdec: torch.compile of the layers failed, running them eagerly: {self.compile_failure}",
                  file=sys.stderr, flush=True)
        self.compile_seconds = time.perf_counter() - began

    def _give_up_graphs(self, exc: BaseException) -> None:
        self.use_graphs = False
        self.graph_failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"specdec: CUDA graph capture failed, decoding eagerly: {self.graph_failure}", file=sys.stderr,
              flush=True)

    def _capture(self, cache: StaticKVCache, rows: int):
        """Warm up on a side stream, then capture one pass of `rows` rows; the warm-ups write the same KV the pass will."""
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._compute(cache, rows, 0)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=cache.pool):
            out = self._compute(cache, rows, 0)
        return graph, out

    def _compute(self, cache: StaticKVCache, rows: int, keep_from: int) -> torch.Tensor:
        """One pass over cache.inputs[:rows]: pure tensor work with fixed shapes (what a graph captures)."""
        ids = cache.inputs[:rows, 0]
        positions = cache.inputs[:rows, 1]
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [rows, 1, head_dim]
        sin = self.sin_signed.index_select(0, positions).unsqueeze(1)
        # Additive causal mask over every slot: a row sees the slots at or before its position.
        visible = self.slot_index.unsqueeze(0) <= positions.unsqueeze(1)  # [rows, slots]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        mask = mask.repeat(self.groups, 1).unsqueeze(0).unsqueeze(0)  # [1, 1, groups * rows, slots]
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        x = F.embedding(ids, self.embed)
        delta = torch.zeros_like(x)  # each layer adds the previous one's MLP output first (fused with its norm)
        for index, w in enumerate(self.layers):
            x, delta = self._layer(x, delta, cache.kv[index], positions, mask, cos, sin, w.norm_attn, w.qkv,
                                   w.qkv_bias, w.q_norm, w.k_norm, w.out, w.norm_mlp, w.gate_up, w.down, shape,
                                   self.eps, self.qk_norm_eps, self.scaling)
        x = F.rms_norm((x + delta)[keep_from:], (self.hidden,), self.final_norm, self.eps)
        return F.linear(x, self.lm_head, self.lm_head_bias).float()


# One layer as a function of tensors: eager as it is, or compiled (torch.compile fuses its element-wise work,
# the rotary embedding and the KV write into a few kernels around the matrix products and attention; a graph
# then replays those).

def _layer(x, delta, kv_cache, positions, mask, cos, sin_signed, norm_attn, qkv_weight, qkv_bias, q_norm, k_norm,
           out_weight, norm_mlp, gate_up_weight, down_weight, shape: tuple[int, int, int], eps: float, qk_eps: float,
           scaling: float):
    """One decoder layer over rows at `positions`: writes their keys and values into kv_cache
    [2 * kv_heads, slots, dim] and returns (x after attention, the MLP's output) for the next layer to add."""
    kv = shape[1]
    x, q, new_kv = _attention_input(x, delta, norm_attn, qkv_weight, qkv_bias, q_norm, k_norm, cos, sin_signed,
                                    shape, eps, qk_eps)
    kv_cache.index_copy_(1, positions, new_kv)
    attn = F.scaled_dot_product_attention(q.unsqueeze(0), kv_cache[:kv].unsqueeze(0), kv_cache[kv:].unsqueeze(0),
                                          attn_mask=mask, scale=scaling)
    return _attention_output_and_mlp(x, attn[0], out_weight, norm_mlp, gate_up_weight, down_weight, shape, eps)


def _attention_input(x, delta, norm, qkv_weight, qkv_bias, q_norm, k_norm, cos, sin_signed,
                     shape: tuple[int, int, int], eps: float, qk_eps: float):
    """Layer input: x + delta, its RMSNorm, the fused q/k/v product, q/k norms and rotary embedding.

    Returns (the residual stream x + delta [rows, hidden], the queries grouped by KV head
    [kv_heads, groups * rows, dim], the new keys then values [2 * kv_heads, rows, dim]).
    """
    heads, kv, dim = shape
    rows = x.shape[0]
    x = x + delta
    y = F.rms_norm(x, (x.shape[-1],), norm, eps)
    qkv = F.linear(y, qkv_weight, qkv_bias).view(rows, heads + 2 * kv, dim)
    if q_norm is not None:
        qkv[:, :heads] = F.rms_norm(qkv[:, :heads], (dim,), q_norm, qk_eps)
        qkv[:, heads : heads + kv] = F.rms_norm(qkv[:, heads : heads + kv], (dim,), k_norm, qk_eps)
    # Rotate q and k in place, so that k and v sit side by side and reach the cache in one write.
    qk = qkv[:, : heads + kv]
    if torch.compiler.is_compiling():
        qk.copy_(_rope(qk, cos, sin_signed))  # TorchDynamo refuses out= into a strided view; the copy fuses
    else:
        _rope(qk, cos, sin_signed, out=qk)
    # Query heads sharing a KV head become rows of one attention over that head: [kv, groups * rows, dim].
    groups = heads // kv
    q = qkv[:, :heads].reshape(rows, kv, groups, dim).permute(1, 2, 0, 3).reshape(kv, groups * rows, dim)
    return x, q, qkv[:, heads:].transpose(0, 1)


def _attention_output_and_mlp(x, attn, out_weight, norm, gate_up_weight, down_weight, shape: tuple[int, int, int],
                              eps: float):
    """Layer output: the attention output [kv_heads, groups * rows, dim] projected and added to x, then the SiLU MLP.

    Returns (x after attention, the MLP's output): the next layer (or the final norm) adds them.
    """
    heads, kv, dim = shape
    rows = x.shape[0]
    attn = attn.reshape(kv, heads // kv, rows, dim).permute(2, 0, 1, 3).reshape(rows, heads * dim)
    x = x + F.linear(attn, out_weight)
    y = F.rms_norm(x, (x.shape[-1],), norm, eps)
    gate, up = F.linear(y, gate_up_weight).chunk(2, dim=-1)
    return x, F.linear(F.silu(gate) * up, down_weight)


def _compiled(function):
    """torch.compile of a private copy of `function`: TorchDynamo keeps its compiled variants per code object,
    so each decoder gets its own (a 7B target and a 0.5B draft never share, or widen, one cache entry)."""
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    return torch.compile(copy, fullgraph=True)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary embedding of x [rows, heads, dim]: x * cos + rotate_half(x) * sin, as transformers computes it.

    out may be x itself: both operands are computed into new tensors before it is written.
    """
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin_signed, out=out)


__all__ = ["DEFAULT_BUCKETS", "StaticDecoder", "StaticKVCache", "static_support"]
