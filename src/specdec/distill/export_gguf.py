"""Write a trained transformers draft (qwen2 or llama architecture) as a GGUF file the llama.cpp backend loads.

Tensor names come from gguf-py's own HF -> GGUF name map; llama's q/k projections are permuted back to
llama.cpp's rotary layout as llama.cpp's convert_hf_to_gguf.py does (qwen2 needs no permutation). The
metadata (hyper-parameters, vocabulary, merges, special tokens, chat template) is copied from the GGUF the
draft was loaded from, so token ids mean the same strings; a draft that came from a transformers directory
gets its hyper-parameters from its config and the vocabulary of the target's GGUF. Weights are written as
F32 or F16 (norms and biases F32) and optionally quantized by llama.cpp's own quantizer (Q8_0, Q4_K_M).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import torch

from specdec.backends.llamacpp.backend import LlamaCppUnavailable, llama_cpp_module

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_k_m")
_LLAMA_FTYPES = {"q8_0": 7, "q4_k_m": 15}  # llama.h: LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_Q4_K_M
_SKIPPED_KEYS = ("GGUF.", "general.architecture", "general.file_type", "general.quantization_version")


class GGUFExportError(ValueError):
    """The draft cannot be written as GGUF here; the message says why (the HF copy is still saved)."""


def _arch(model):
    archs = {"qwen2": gguf.MODEL_ARCH.QWEN2, "llama": gguf.MODEL_ARCH.LLAMA}
    model_type = getattr(model.config, "model_type", None)
    if model_type not in archs:
        raise GGUFExportError(
            f"GGUF export supports qwen2 and llama drafts, not {model_type!r}; convert the saved directory with "
            f"llama.cpp's convert_hf_to_gguf.py"
        )
    return archs[model_type]


def _permute_rotary(weights: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half layout -> llama.cpp's interleaved pairs (convert_hf_to_gguf.py LlamaModel.permute)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )


def _copy_fields(writer, reader, prefix: str = "") -> None:
    for field in reader.fields.values():
        if field.name.startswith(_SKIPPED_KEYS) or not field.name.startswith(prefix):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type)


def _config_fields(writer, config) -> None:
    """Hyper-parameters of a qwen2/llama config under the names llama.cpp reads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    writer.add_context_length(int(text.max_position_embeddings))
    writer.add_embedding_length(int(text.hidden_size))
    writer.add_block_count(int(text.num_hidden_layers))
    writer.add_feed_forward_length(int(text.intermediate_size))
    writer.add_head_count(int(text.num_attention_heads))
    writer.add_head_count_kv(int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads))
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    writer.add_rope_freq_base(float(theta or getattr(text, "rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(text.rms_norm_eps))


def write_gguf(model, path: str | Path, source_gguf: str | Path | None = None,
               vocab_gguf: str | Path | None = None, dtype: str = "f16") -> Path:
    """Write `model` to `path` as F32/F16 GGUF with the metadata of source_gguf, else config + vocab_gguf's vocabulary."""
    if dtype not in ("f32", "f16"):
        raise GGUFExportError(f"write_gguf writes f32 or f16, not {dtype!r} (quantize afterwards)")
    if source_gguf is None and vocab_gguf is None:
        raise GGUFExportError("no GGUF to take the vocabulary from (neither the draft nor the target is a GGUF file)")
    arch = _arch(model)
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, kv_heads = int(text.num_attention_heads), int(getattr(text, "num_key_value_heads", 0) or text.num_attention_heads)
    names = gguf.get_tensor_name_map(arch, int(text.num_hidden_layers))
    tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), gguf.MODEL_ARCH_NAMES[arch])
    if source_gguf is not None:
        _copy_fields(writer, gguf.GGUFReader(str(source_gguf)))
    else:
        _config_fields(writer, config)
        _copy_fields(writer, gguf.GGUFReader(str(vocab_gguf)), prefix="tokenizer.")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)

    for name, tensor in model.state_dict().items():
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue  # recomputed by llama.cpp / the output reuses token_embd when the file has no output.weight
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise GGUFExportError(f"no GGUF name for tensor {name!r}")
        data = tensor.detach().to(torch.float32).cpu().numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith("q_proj.weight"):
            data = _permute_rotary(data, heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and name.endswith("k_proj.weight"):
            data = _permute_rotary(data, kv_heads)
        if dtype == "f16" and data.ndim == 2:
            data = data.astype(np.float16)
        writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path


def quantize_gguf(source: str | Path, destination: str | Path, kind: str = "q4_k_m", threads: int = 0) -> Path:
    """Quantize a GGUF with llama.cpp's quantizer (the one that wrote the default pair's files)."""
    if kind not in _LLAMA_FTYPES:
        raise GGUFExportError(f"unknown quantization {kind!r}; choose from {', '.join(_LLAMA_FTYPES)}")
    try:
        llama_cpp = llama_cpp_module()
    except LlamaCppUnavailable as exc:
        raise GGUFExportError(f"quantizing to {kind} needs llama-cpp-python: {exc}") from exc
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _LLAMA_FTYPES[kind]
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(destination).encode(), ctypes.byref(params))
    if status != 0:
        raise GGUFExportError(f"llama.cpp could not quantize {source} to {kind} (status {status})")
    return Path(destination)


def export_gguf(model, path: str | Path, source_gguf=None, vocab_gguf=None, kind: str = "f16",
                threads: int = 0) -> Path:
    """Write the draft as `kind` (f32, f16, q8_0, q4_k_m) GGUF at path; quantized kinds go through an F16 file."""
    if kind not in GGUF_TYPES:
        raise GGUFExportError(f"unknown GGUF type {kind!r}; choose from {', '.join(GGUF_TYPES)}")
    path = Path(path)
    if kind in ("f32", "f16"):
        return write_gguf(model, path, source_gguf, vocab_gguf, kind)
    staging = path.with_name(path.stem + "-f16.gguf")
    write_gguf(model, staging, source_gguf, vocab_gguf, "f16")
    try:
        return quantize_gguf(staging, path, kind, threads)
    finally:
        staging.unlink(missing_ok=True)


__all__ = ["GGUF_TYPES", "GGUFExportError", "export_gguf", "quantize_gguf", "write_gguf"]
