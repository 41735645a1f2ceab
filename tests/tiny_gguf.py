"""Tiny random-weight Qwen2 GGUF files written in the test (gguf's GGUFWriter), loadable by llama.cpp and transformers.

A small byte-level BPE vocabulary (the 256 GPT-2 byte symbols, a few merges, ChatML specials) and a
ChatML template go into the file, so the tokenizer specdec reads from a GGUF works on it too. Weights
are F32, F16 or Q4_0 (gguf-py quantizes Q4_0 itself); norms and biases stay F32. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Merged tokens (each built from two existing ones) so the tokenizer is a real BPE, not bytes only.
MERGES = (
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("r", "e"), ("o", "n"), ("Ġ", "s"),
    ("e", "r"), ("Ġ", "c"), ("d", "e"), ("de", "f"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("e", "t"), ("r", "et"),
    ("u", "r"), ("ret", "ur"), ("retur", "n"), ("Ġ", "f"), ("Ġ", "x"), ("Ċ", "ĠĠĠĠ"), ("Ġ", "i"),
    ("Ġi", "n"), ("o", "r"), ("Ġf", "or"),
)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_symbols() -> list[str]:
    """GPT-2's byte -> printable unicode map, in byte order (what byte-level BPE vocabularies store)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    codes, extra = [], 0
    for b in range(256):
        if b in printable:
            codes.append(b)
        else:
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


# Qwen2.5-Coder's fill-in-the-middle and repository tokens, after the other specials in a `fim=True` file (so
# every other id is the same as in a file without them); llama.cpp finds them by their text, as in the default
# pair's GGUF, which names no FIM ids.
FIM_SPECIALS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


# Hermes tool-call tags, as Qwen2.5 has them: added tokens that are not control tokens (GGUF type 4, user defined).
TOOL_TAGS = ("<tool_call>", "</tool_call>")
# A Hermes-style template (the syntax Qwen2.5's own template teaches), written for these tests: tools in the system
# turn (newlines after a block tag written as expressions: transformers renders with trim_blocks), an assistant's
# calls as <tool_call> blocks, tool results as <tool_response> in a user turn. A system
# message after the first is a template error, as in Qwen2.5's.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\nCall one as <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if message.role == 'system' and not loop.first %}{{ raise_exception('a system message must come first') }}"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% if message.content %}{{ '\n' }}{{ message.content }}{% endif %}"
    '{% for call in message.tool_calls %}{{ "\\n" }}<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocabulary(fim: bool = False, tools: bool = False) -> tuple[list[str], list[int], list[str]]:
    """Tokens, their GGUF token types (1 normal, 3 control, 4 user defined) and the merges, in id order."""
    tokens = byte_symbols()
    for left, right in MERGES:
        assert left in tokens and right in tokens, (left, right)
        tokens.append(left + right)
    specials = SPECIALS + (FIM_SPECIALS if fim else ())
    types = [1] * len(tokens) + [3] * len(specials)
    tokens += list(specials)
    if tools:
        tokens += list(TOOL_TAGS)
        types += [4] * len(TOOL_TAGS)
    return tokens, types, [f"{left} {right}" for left, right in MERGES]


VOCAB = len(vocabulary()[0])
FIM_IDS = {text: VOCAB + i for i, text in enumerate(FIM_SPECIALS)}  # in a fim=True file
EOS_ID = VOCAB - 1  # <|im_end|>
ENDOFTEXT_ID = VOCAB - 3


def write_tiny_gguf(
    path: str | Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    context: int = 1024,
    dtype: str = "f32",
    scale: float = 8.0,
    noise: float = 0.0,
    fim: bool = False,
    tools: bool = False,
) -> Path:
    """Write a random Qwen2 model; 2-D weights are scaled by `scale` so logits are peaked (argmax is not a
    rounding decision). dtype: "f32", "f16" or "q4_0" (2-D weights except the embedding). noise > 0 adds
    independent noise of that relative size to every 2-D weight: a model correlated with the one of the
    same seed, but not equal (a draft that is sometimes right). fim=True adds the FIM_SPECIALS tokens; tools=True
    the TOOL_TAGS tokens and TOOL_CHAT_TEMPLATE in place of the plain chat template."""
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    noise_rng = np.random.default_rng(seed + 1_000_003)
    tokens, types, merges = vocabulary(fim, tools)
    vocab = len(tokens)
    head_dim = hidden // heads
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[dtype]

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(f"tiny-qwen2-{seed}")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(file_type)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(EOS_ID)
    writer.add_bos_token_id(ENDOFTEXT_ID)
    writer.add_pad_token_id(ENDOFTEXT_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE)

    def matrix(rows: int, cols: int, quantize: bool = True):
        data = rng.standard_normal((rows, cols)) * 0.02 * scale
        if noise:
            data = data + noise_rng.standard_normal((rows, cols)) * 0.02 * scale * noise
        data = data.astype(np.float32)
        if dtype == "f16":
            return data.astype(np.float16), None
        if dtype == "q4_0" and quantize:
            return gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_0), gguf.GGMLQuantizationType.Q4_0
        return data, None

    def vector(n: int, around: float = 0.0) -> np.ndarray:
        return (around + rng.standard_normal(n) * 0.02).astype(np.float32)

    def add(name: str, value) -> None:
        data, qtype = value if isinstance(value, tuple) else (value, None)
        writer.add_tensor(name, data, raw_dtype=qtype)

    add("token_embd.weight", matrix(vocab, hidden, quantize=False))
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", vector(hidden, 1.0))
        add(f"blk.{i}.attn_q.weight", matrix(heads * head_dim, hidden))
        add(f"blk.{i}.attn_q.bias", vector(heads * head_dim))
        add(f"blk.{i}.attn_k.weight", matrix(kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_k.bias", vector(kv_heads * head_dim))
        add(f"blk.{i}.attn_v.weight", matrix(kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_v.bias", vector(kv_heads * head_dim))
        add(f"blk.{i}.attn_output.weight", matrix(hidden, heads * head_dim))
        add(f"blk.{i}.ffn_norm.weight", vector(hidden, 1.0))
        add(f"blk.{i}.ffn_gate.weight", matrix(ffn, hidden))
        add(f"blk.{i}.ffn_up.weight", matrix(ffn, hidden))
        add(f"blk.{i}.ffn_down.weight", matrix(hidden, ffn))
    add("output_norm.weight", vector(hidden, 1.0))
    add("output.weight", matrix(vocab, hidden))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantize_q4_k_m(source: str | Path, destination: str | Path) -> Path:
    """Quantize a GGUF with llama.cpp's own quantizer to Q4_K_M (K-quants need rows of 256: hidden >= 256).

    gguf-py cannot write K-quants, and they are what the default models use and what llama.cpp's
    repacked and tiled kernels handle.
    """
    import ctypes

    from specdec.backends.llamacpp.backend import llama_cpp_module

    llama_cpp = llama_cpp_module()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 1
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(destination).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed with status {status}")
    return Path(destination)
