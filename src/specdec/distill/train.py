"""Train a draft model toward the target's distributions: load it as a trainable transformers model (GGUF de-quantized),
full fine-tuning or LoRA (merged afterwards), AdamW, a progress bar with the loss, seeded; save it in HF format."""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.config import ConfigError
from specdec.distill.data import DistillExample
from specdec.distill.losses import LOSSES, divergence, restrict_to_vocab
from specdec.loading.models import (
    DEFAULT_MODELS,
    ModelLoadError,
    drop_gguf_marker,
    from_pretrained_kwargs,
    hub_kwargs,
    resolve,
    save_converted,
    torch_source,
)
from specdec.loading.progress import long_work_bars

METHODS = ("lora", "full")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_LR = {"lora": 2e-4, "full": 2e-5}


@dataclass(frozen=True)
class TrainConfig:
    """How the draft is trained. lr None: 2e-4 for LoRA, 2e-5 for full fine-tuning."""

    method: str = "lora"
    loss: str = "fkl"
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimizer steps (0: no training at all)
    lr: float | None = None
    batch_size: int = 4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    dtype: str = "fp32"
    device: str = "auto"  # "auto": cuda when present, else cpu
    seed: int = 0

    def __post_init__(self) -> None:
        checks = (
            (self.method in METHODS, f"--method must be one of {', '.join(METHODS)}, got {self.method!r}"),
            (self.loss in LOSSES, f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}"),
            (self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}"),
            (self.max_steps is None or self.max_steps >= 0, f"--max-steps must be >= 0, got {self.max_steps}"),
            (self.lr is None or (math.isfinite(self.lr) and self.lr >= 0), f"--lr must be >= 0, got {self.lr}"),
            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
            (self.lora_rank >= 1, f"--lora-rank must be >= 1, got {self.lora_rank}"),
            (self.dtype in DTYPES, f"--train-dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
            (self.device in ("auto", "cpu") or self.device.startswith("cuda"),
             f"--device must be auto, cpu or cuda[:N], got {self.device!r}"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def learning_rate(self) -> float:
        return DEFAULT_LR[self.method] if self.lr is None else self.lr


@dataclass
class TrainResult:
    """What training did: optimizer steps, the loss of each step, tokens seen, seconds."""

    steps: int = 0
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    device: str = "cpu"
    trainable_parameters: int = 0

    def to_dict(self) -> dict:
        first = self.losses[: max(1, len(self.losses) // 10)]
        last = self.losses[-max(1, len(self.losses) // 10):]
        return {
            "steps": self.steps, "tokens": self.tokens, "seconds": round(self.seconds, 3), "device": self.device,
            "trainable_parameters": self.trainable_parameters,
            "loss_first": round(sum(first) / len(first), 5) if self.losses else None,
            "loss_last": round(sum(last) / len(last), 5) if self.losses else None,
            "losses": [round(x, 5) for x in self.losses],
        }


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is available")
    return torch.device(name)


def load_trainable_draft(reference: str, dtype: str = "fp32"):
    """The draft as a plain, trainable transformers model (GGUF weights de-quantized), and its source GGUF or None.

    Uses the model references of specdec.loading.models (hub id, directory, .gguf, the packaged default draft and its
    cached transformers copy), but none of the inference-only weight formats (packed or int8 linears).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow to import: here, not at CLI start

    reference = "default-draft" if reference == "default" else reference
    resolved = resolve(reference)
    gguf_path = Path(resolved.source) / resolved.gguf_file if resolved.gguf_file else None
    source = torch_source(reference, resolved)
    kwargs = {"dtype": DTYPES[dtype], **from_pretrained_kwargs(source), **hub_kwargs(source)}
    try:
        with long_work_bars():
            model = AutoModelForCausalLM.from_pretrained(source.source, **kwargs)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"could not load draft model {reference!r} for training: {exc}") from exc
    if source.gguf_file:
        drop_gguf_marker(model)
        if reference in DEFAULT_MODELS:
            # Keep the transformers copy the torch backend would keep, so the next load takes seconds.
            save_converted(model, AutoTokenizer.from_pretrained(source.source, gguf_file=source.gguf_file), gguf_path)
    return model, gguf_path


def require_peft(config: TrainConfig) -> None:
    """LoRA needs peft; say so before minutes are spent generating data."""
    if config.method == "lora" and importlib.util.find_spec("peft") is None:
        raise ConfigError("--method lora needs peft: pip install 'specdec[distill]' (or use --method full)")


def _wrap_lora(model, config: TrainConfig):
    from peft import LoraConfig, get_peft_model  # the distill extra (require_peft checked it first)

    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def _batches(examples: Sequence[DistillExample], config: TrainConfig) -> list[list[DistillExample]]:
    order = list(range(len(examples)))
    rng = random.Random(config.seed)
    batches = []
    for _ in range(config.epochs):
        rng.shuffle(order)
        batches += [[examples[i] for i in order[lo:lo + config.batch_size]]
                    for lo in range(0, len(order), config.batch_size)]
    if config.max_steps is not None:
        batches = batches[: config.max_steps]
    return batches


def _takes_logits_to_keep(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def batch_loss(model, batch: Sequence[DistillExample], loss: str, device: torch.device) -> tuple[torch.Tensor, int]:
    """The divergence over every continuation position of a batch, and how many positions that was.

    Rows are left-padded so every continuation ends at the last position: the draft's LM head then only runs
    on the last max(len(continuation)) positions (logits_to_keep), which bounds memory on a 150k vocabulary.
    """
    # The last continuation token is never an input: nothing after it is predicted.
    inputs = [e.prompt + e.continuation[:-1] for e in batch]
    width = max(len(x) for x in inputs)
    keep = max(len(e.continuation) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, x in enumerate(inputs):
        ids[row, width - len(x):] = torch.tensor(x)
        mask[row, width - len(x):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    kwargs = {"logits_to_keep": keep} if _takes_logits_to_keep(model) else {}
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                use_cache=False, **kwargs)
    logits = out.logits[:, -keep:]  # [batch, keep, vocab]
    vocab = logits.shape[-1]
    rows = torch.cat([logits[row, keep - len(e.continuation):] for row, e in enumerate(batch)])
    target_ids = torch.cat([e.topk_ids for e in batch]).to(device)
    target_log_probs = torch.cat([restrict_to_vocab(e.topk_ids, e.topk_log_probs, vocab) for e in batch]).to(device)
    draft_log_probs = torch.log_softmax(rows.float(), dim=-1)
    return divergence(loss, draft_log_probs, target_ids, target_log_probs), rows.shape[0]


def train_draft(model, examples: Sequence[DistillExample], config: TrainConfig | None = None,
                progress: bool = True):
    """Train `model` toward the examples' target distributions; return (the trained plain model, TrainResult).

    LoRA adapters are merged into the weights before returning, so the result saves and loads like the input.
    """
    config = config or TrainConfig()
    require_peft(config)
    if not examples:
        raise ValueError("no training examples (every prompt was skipped?)")
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    model = model.to(device=device, dtype=DTYPES[config.dtype])
    if config.method == "lora":
        model = _wrap_lora(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    result = TrainResult(device=str(device), trainable_parameters=sum(p.numel() for p in params))
    batches = _batches(examples, config)
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    began = time.perf_counter()
    bar = tqdm(batches, desc=f"distill ({config.method}, {config.loss})", unit="step", disable=not progress)
    for batch in bar:
        loss, positions = batch_loss(model, batch, config.loss, device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        result.steps += 1
        result.tokens += positions
        result.losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{result.losses[-1]:.4f}")
    result.seconds = time.perf_counter() - began
    if config.method == "lora":
        model = model.merge_and_unload()
    return model.eval(), result


@torch.no_grad()
def mean_divergence(model, examples: Sequence[DistillExample], loss: str = "fkl", batch_size: int = 4) -> float:
    """The divergence of `model` to the examples' target distributions, averaged over positions (no training)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for lo in range(0, len(examples), batch_size):
        value, positions = batch_loss(model, examples[lo:lo + batch_size], loss, device)
        total += float(value) * positions
        count += positions
    model.train(was_training)
    return total / count if count else float("nan")


def save_draft(model, out_dir: str | Path, tokenizer=None) -> Path:
    """save_pretrained the model (and a tokenizer) into out_dir: a directory `--draft DIR` loads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    _readable_like_any_new_file(out)
    return out


def _readable_like_any_new_file(directory: Path) -> None:
    """Give the saved files the mode the user's umask gives any new file (safetensors writes 0600 temp files)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


__all__ = [
    "DEFAULT_LR", "METHODS", "TrainConfig", "TrainResult", "batch_loss", "load_trainable_draft", "mean_divergence",
    "resolve_device", "save_draft", "train_draft",
]
