"""Dummy-weight models of real shapes (vLLM's --load-format dummy): Qwen2.5 configs initialised on the device, for benchmarks where no checkpoint can be loaded.

Speed does not depend on weight values (every matrix product and kernel is the same), so a random
model of a real architecture measures real costs. What random weights cannot give is agreement: in
bf16 their logits are nearly tied, so argmax flips between a one-row and a k-row pass and no draft
is ever accepted. So every dummy model here is given the same "successor" rule by construction:

- the embedding is scaled up and the layers' output projections down, so the token's own embedding
  dominates the residual stream after every layer (each layer's input is normalised, so what the
  layers add does not grow with the embedding);
- row y of the LM head is the embedding of the token whose successor is y, so the logit of
  successor(x) is |e_x|^2-large and every other logit is a near-orthogonal dot product.

The greedy text is then successor(x), successor(successor(x)), ... with wide logit gaps that bf16
rounding does not flip, and a draft built with the same successor table (any size) agrees with the
target: these numbers measure what passes cost and what a perfect drafter buys, never a real
draft's acceptance. Every model here has one vocabulary size, so the pair checks pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DUMMY_VOCAB = 152064  # Qwen2.5-7B's (the 0.5B and 1.5B checkpoints pad to 151936); one size for every shape
EMBED_SCALE = 16.0
BRANCH_SCALE = 0.02  # on the attention and MLP output projections: what each layer adds to the residual


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


# The published Qwen2.5 configurations (hidden, MLP, layers, attention heads, KV heads); "tiny" is for tests.
SHAPES = {
    "qwen2.5-7b": Shape(3584, 18944, 28, 28, 4),
    "qwen2.5-3b": Shape(2048, 11008, 36, 16, 2),
    "qwen2.5-1.5b": Shape(1536, 8960, 28, 12, 2),
    "qwen2.5-0.5b": Shape(896, 4864, 24, 14, 2),
    "tiny": Shape(64, 128, 2, 4, 2),
}


def dummy_config(shape: str, vocab: int = DUMMY_VOCAB, max_positions: int = 32768):
    """A Qwen2Config of the named shape (untied LM head: the successor rule needs its own head)."""
    from transformers import Qwen2Config  # slow to import: here, not at CLI start

    if shape not in SHAPES:
        raise ValueError(f"unknown dummy shape {shape!r}; choose from {', '.join(SHAPES)}")
    s = SHAPES[shape]
    return Qwen2Config(
        vocab_size=vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, max_position_embeddings=max_positions,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def successor_table(vocab: int = DUMMY_VOCAB, seed: int = 0) -> torch.Tensor:
    """A random permutation: successor[x] is the token every dummy model predicts after x."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))


def build_dummy_model(shape: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                      successor: torch.Tensor | None = None, seed: int = 0, vocab: int = DUMMY_VOCAB,
                      max_positions: int = 32768):
    """A Qwen2ForCausalLM of `shape`, random weights made on `device` in `dtype`, with the successor rule."""
    from transformers import Qwen2ForCausalLM  # slow to import: here, not at CLI start

    config = dummy_config(shape, vocab, max_positions)
    successor = successor_table(vocab) if successor is None else successor
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval().requires_grad_(False)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        predecessor = torch.empty_like(successor)
        predecessor[successor] = torch.arange(len(successor))
        head.copy_(embed[predecessor.to(embed.device)])
        embed.mul_(EMBED_SCALE)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(BRANCH_SCALE)
            layer.mlp.down_proj.weight.mul_(BRANCH_SCALE)
    return model


def dummy_prompts(successor: torch.Tensor, count: int, length: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """(kind, ids) prompts of `length` random ids, kinds alternating from "copy": a copy prompt holds,
    mid-prompt, the successor chain the output will follow (text that repeats its input: what prompt
    lookup copies); a fresh one does not."""
    generator = torch.Generator().manual_seed(seed)
    vocab = len(successor)
    prompts = []
    for i in range(count):
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        kind = "copy" if i % 2 == 0 else "fresh"
        if kind == "copy":
            chain_length = length // 2
            chain = [ids[-1]]
            for _ in range(chain_length - 1):
                chain.append(int(successor[chain[-1]]))
            begin = length // 4
            ids[begin : begin + chain_length] = chain
            ids[-1] = chain[0]
        prompts.append((kind, ids))
    return prompts


def weight_bytes(model) -> int:
    """Bytes of every parameter: what one decoding pass must read at least once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


__all__ = ["DUMMY_VOCAB", "SHAPES", "build_dummy_model", "dummy_config", "dummy_prompts", "successor_table",
           "weight_bytes"]
