"""specdec distill: train a draft model toward its target on the user's prompts (DistillSpec-style), as a library.

    from specdec.distill import DistillOptions, TrainConfig, distill, split_prompt_file
    report = distill("target.gguf", "draft.gguf", split_prompt_file("prompts.jsonl", holdout=20), "distilled/",
                     DistillOptions(train=TrainConfig(method="lora", epochs=2)))

The steps are public too: collect_examples (target continuations with top-K log-probs), load_trainable_draft,
train_draft, save_draft, export_gguf, evaluate_draft / compare / write_report.
"""

from specdec.distill.data import (
    DEFAULT_TOP_K,
    DistillExample,
    PromptSplit,
    TopKRecorder,
    collect_examples,
    load_examples,
    load_prompt_file,
    save_examples,
    split_prompt_file,
    split_task,
)
from specdec.distill.evaluate import compare, evaluate_draft, write_report
from specdec.distill.export_gguf import GGUF_TYPES, GGUFExportError, export_gguf
from specdec.distill.losses import LOSSES, forward_kl, total_variation
from specdec.distill.run import DistillOptions, distill, encode_prompts
from specdec.distill.train import (
    TrainConfig,
    TrainResult,
    load_trainable_draft,
    mean_divergence,
    save_draft,
    train_draft,
)

__all__ = [
    "DEFAULT_TOP_K", "GGUF_TYPES", "LOSSES", "DistillExample", "DistillOptions", "GGUFExportError", "PromptSplit",
    "TopKRecorder", "TrainConfig", "TrainResult", "collect_examples", "compare", "distill", "encode_prompts",
    "evaluate_draft", "export_gguf", "forward_kl", "load_examples", "load_prompt_file", "load_trainable_draft",
    "mean_divergence", "save_draft", "save_examples", "split_prompt_file", "split_task", "total_variation",
    "train_draft", "write_report",
]
