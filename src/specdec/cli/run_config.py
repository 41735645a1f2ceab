"""The run-config file (`--config FILE` of generate, serve and bench): a ModelRef, a SpecConfig and optionally
SamplingParams as JSON, and its mapping onto the subcommands' argparse destinations.

    {"specdec_config": 1,
     "model": {"type": "ModelRef", "target": ..., "draft": ..., ...},
     "spec": {"type": "SpecConfig", "drafter": ..., "num_speculative_tokens": ..., "k_policy": ...},
     "sampling": {"type": "SamplingParams", ...},      (optional; tune does not write it)
     "tune": {...}}                                     (what tune measured; informational)

Each section is config.to_json's form and is read back with config.from_json, so it is validated like the
constructor. Values from the file are defaults: a flag given on the command line wins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdec.config import ConfigError, ModelRef, SamplingParams, SpecConfig, from_json, to_json

FORMAT_VERSION = 1
_SECTIONS = {"model": ModelRef, "spec": SpecConfig, "sampling": SamplingParams}
# SpecConfig fields without a command-line flag: set on the parsed arguments directly.
FLAGLESS_SPEC_FIELDS = ("lookup_min_ngram", "lookup_max_ngram")


@dataclass(frozen=True)
class RunConfig:
    """A loaded config file; any section may be absent."""

    model: ModelRef | None = None
    spec: SpecConfig | None = None
    sampling: SamplingParams | None = None
    info: dict | None = None


def write_run_config(path: str | Path, model: ModelRef | None = None, spec: SpecConfig | None = None,
                     sampling: SamplingParams | None = None, info: dict | None = None) -> Path:
    """Write the sections given (and `info` under "tune") as one JSON file; returns the path."""
    data: dict = {"specdec_config": FORMAT_VERSION}
    for name, value in (("model", model), ("spec", spec), ("sampling", sampling)):
        if value is not None:
            data[name] = json.loads(to_json(value))
    if info is not None:
        data["tune"] = info
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def read_run_config(path: str | Path) -> RunConfig:
    """Load and validate a config file; ConfigError (one line) for a missing file, bad JSON or bad values."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON ({exc.msg}, line {exc.lineno})") from exc
    if not isinstance(data, dict) or data.get("specdec_config") != FORMAT_VERSION:
        raise ConfigError(f"{path} is not a specdec config file (expected \"specdec_config\": {FORMAT_VERSION})")
    unknown = set(data) - {"specdec_config", "tune", *_SECTIONS}
    if unknown:
        raise ConfigError(f"config file {path}: unknown sections {sorted(unknown)}")
    loaded = {}
    for name, cls in _SECTIONS.items():
        section = data.get(name)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"config file {path}: {name!r} must be an object")
        try:
            loaded[name] = from_json(json.dumps({"type": cls.__name__, **section}))
        except TypeError as exc:
            raise ConfigError(f"config file {path}: {name}: {exc}") from exc
        except ConfigError as exc:
            raise ConfigError(f"config file {path}: {name}: {exc}") from exc
        if not isinstance(loaded[name], cls):
            raise ConfigError(f"config file {path}: {name!r} holds a {type(loaded[name]).__name__}")
    return RunConfig(**loaded, info=data.get("tune"))


def bench_method_name(spec: SpecConfig) -> str | None:
    """The `specdec bench` method that runs this SpecConfig (its k from -k / --k-max), or None if bench has none."""
    drafter, policy = spec.drafter, spec.k_policy
    if drafter == "none":
        return "plain"
    if drafter == "draft_model":
        return {"fixed": f"spec_k{spec.num_speculative_tokens}", "adaptive": "adaptive",
                "heuristic": "heuristic"}.get(policy)
    if drafter in ("prompt_lookup", "suffix", "hybrid"):
        return {"fixed": drafter, "adaptive": f"{drafter}_adaptive"}.get(policy)
    return None


def argument_defaults(config: RunConfig) -> dict:
    """argparse destination -> value for every setting in the file (filter by the destinations a parser has).

    generate and serve read -k/--drafter/--k-policy; bench reads the same SpecConfig as --methods (the one bench
    method that runs it) with -k and --k-max.
    """
    out: dict = {}
    ref = config.model
    if ref is not None:
        out["model"] = "default" if ref.target in ("default", "default-target") else ref.target
        out["draft"] = ref.draft
        # Giving a weight format selects torch under --backend auto: only carry one a torch run chose.
        if ref.backend == "torch" or ref.weight_format != "fp32":
            out["weight_format"] = ref.weight_format
        out["draft_weight_format"] = ref.draft_weight_format or "same"
        out.update(max_context=ref.max_context, backend=ref.backend, threads=ref.threads,
                   batch_invariant=ref.batch_invariant)
    spec = config.spec
    if spec is not None:
        out.update(k=spec.num_speculative_tokens, drafter=spec.drafter, k_policy=spec.k_policy,
                   draft_p_min=spec.draft_p_min)
        method = bench_method_name(spec)
        if method is not None:
            out["methods"] = method
            if spec.k_policy == "adaptive":
                out["k_max"] = spec.num_speculative_tokens
    params = config.sampling
    if params is not None:
        out.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                   max_tokens=params.max_tokens, stop=list(params.stop), seed=params.seed,
                   ignore_eos=params.ignore_eos)
    return out


def flagless_values(config: RunConfig) -> dict:
    """Settings no flag can override (the prompt-lookup n-gram sizes), set on the parsed arguments as they are."""
    if config.spec is None:
        return {}
    return {name: getattr(config.spec, name) for name in FLAGLESS_SPEC_FIELDS}


__all__ = [
    "FORMAT_VERSION", "RunConfig", "argument_defaults", "bench_method_name", "flagless_values", "read_run_config",
    "write_run_config",
]
