"""specdec tune: choose the draft (model, drafter and k policy) by measuring candidates on your prompts, as a library.

    from specdec.loading.models import load_backend
    from specdec.tune import DraftCandidate, TuneOptions, tune, write_outputs
    target = load_backend("target.gguf", role="target")
    result = tune(target, [DraftCandidate("d", "draft.gguf")], prompts, TuneOptions(),
                  load_draft=lambda ref: load_backend(ref, role="draft"))
    result.rows[0], result.recommendation          # ranked rows; the winner, or plain decoding
    write_outputs(result, "tune-out/", base_ref=ModelRef(target="target.gguf", draft=None))

`read_run_config` / `write_run_config` read and write the config file generate, serve and bench take (--config).
"""

from specdec.cli.run_config import (
    RunConfig,
    argument_defaults,
    bench_method_name,
    read_run_config,
    write_run_config,
)
from specdec.core.intervals import SpeedupInterval, paired_ratios, speedup_interval
from specdec.tune.candidates import (
    DRAFTERS,
    K_POLICIES,
    DraftCandidate,
    PolicyChoice,
    TuneOptions,
    methods_for,
    parse_drafts,
)
from specdec.tune.ranking import Recommendation, rank
from specdec.tune.report import to_markdown, tuned_model_ref, write_outputs
from specdec.tune.run import TuneResult, rows_from_results, tune

__all__ = [
    "DRAFTERS", "K_POLICIES", "DraftCandidate", "PolicyChoice", "Recommendation", "RunConfig", "SpeedupInterval",
    "TuneOptions", "TuneResult", "argument_defaults", "bench_method_name", "methods_for", "paired_ratios",
    "parse_drafts", "rank", "read_run_config", "rows_from_results", "speedup_interval", "to_markdown", "tune",
    "tuned_model_ref", "write_outputs", "write_run_config",
]
