"""POST /infill as llama-server answers it (what llama.vscode and llama.vim send), and the FIM prompt that
/v1/completions builds from `prompt` + `suffix`.

The request is llama-server's: `input_prefix`, `input_suffix`, `input_extra` (other files), `prompt`
(text typed after the prefix) and its /completion options with llama-server's defaults; the prompt is
laid out as llama-server lays it (specdec.fim), so both servers see the same token ids. The answer
carries the fields those clients read (content, timings, tokens_cached, truncated, stop_type); streamed,
one `data:` event per engine step and the full object last, without `[DONE]`, as llama-server does.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec.config import ConfigError, SamplingParams
from specdec.fim import ExtraChunk, InfillPrompt, InfillWindow
from specdec.server.dispatch import JobStreamingResponse, check_fits, submit
from specdec.server.errors import APIError, bad_request, error_responses, unsupported
from specdec.server.infill_reply import InfillReply
from specdec.server.request_limits import check_prompt_chars
from specdec.server.schemas import (
    Stop,
    StrictModel,
    checked_penalties,
    logit_bias_pairs,
    refuse_lone_surrogates,
)

# llama-server's default -b: its window takes the prefix's last 3/4 of it and the suffix's first 1/4 (at most half
# the context here, so a small context keeps room for the extra files and the completion).
FIM_BATCH = 2048
MAX_EXTRA_CHUNKS = 256
MAX_COMPLETIONS = 8  # n_cmpl: llama.vscode asks for 3
# Tokens the extra files' window leaves for the completion, twice over as llama-server reserves 2 x n_predict
# (llama.vscode's n_predict); a request asking more than the context leaves gets what is left (stop_type limit).
INFILL_RESERVE = 128
# llama-server's sampler names. Those specdec applies; those that do nothing at the values this endpoint accepts
# (their own parameters are refused unless neutral); and llama.cpp's "infill" sampler, not implemented here:
# accepted so llama.vscode's request is served, and reported in generation_settings.samplers_not_applied.
APPLIED_SAMPLERS = ("top_k", "top_p", "min_p", "temperature")
NEUTRAL_SAMPLERS = ("penalties", "dry", "typ_p", "typical_p", "xtc", "top_n_sigma")
UNAPPLIED_SAMPLERS = ("infill",)
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama-server's "pick a seed"


class InfillChunk(BaseModel):
    """One extra file: its text and name; other keys (llama.vscode's `time`) are ignored, as llama-server does."""

    model_config = ConfigDict(extra="ignore", strict=True)
    text: str
    filename: str = "tmp"


class InfillRequest(StrictModel):
    """llama-server's /infill body. Defaults are llama-server's (temperature 0.8, top_k 40, top_p 0.95, min_p
    0.05); `id_slot`, `cache_prompt` and `t_max_prompt_ms` are accepted and change nothing (the slot sharing the
    longest prefix is taken, prefixes are always reused, llama-server does not implement t_max_prompt_ms)."""

    input_prefix: str
    input_suffix: str
    input_extra: Annotated[list[InfillChunk], Field(max_length=MAX_EXTRA_CHUNKS)] = []
    prompt: str = ""
    model: str | None = None
    n_predict: int | None = None
    max_tokens: int | None = None
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1
    stop: Stop | None = None
    stream: bool = False
    samplers: list[str] | None = None
    n_cmpl: int = 1
    n_indent: int = 0
    t_max_predict_ms: int = 0
    t_max_prompt_ms: int = -1
    response_fields: list[str] | None = None
    return_tokens: bool = False
    ignore_eos: bool = False
    id_slot: int = -1
    cache_prompt: bool = True
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    prompt_cache_key: str | None = None
    # llama-server's penalties sampler (applied when "penalties" is in samplers) and logit_bias: [[id, bias], ...]
    # or {"id": bias}, a bias of false bans the id.
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: list[list[int | float | bool]] | dict[str, float | bool] | None = None
    # Refused unless neutral: they would change what is generated and are not implemented.
    lora: list[Any] | None = None
    n_probs: int = 0
    typical_p: float = 1.0
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)


def infill_sampling(req: InfillRequest, room: int) -> tuple[SamplingParams, list[str], int]:
    """SamplingParams as llama-server's sampler chain would run them, the sampler names not applied, and the
    tokens the client asked for (0: none, the prompt is only cached; llama-server's n_predict 0)."""
    for name, neutral in (("typical_p", 1.0), ("n_probs", 0)):
        if getattr(req, name) != neutral:
            raise unsupported(name, "it changes the target distribution and is not implemented")
    for name in ("lora", "grammar", "json_schema"):
        if getattr(req, name):
            raise unsupported(name)
    samplers = list(DEFAULT_SAMPLERS if req.samplers is None else req.samplers)
    known = APPLIED_SAMPLERS + NEUTRAL_SAMPLERS + UNAPPLIED_SAMPLERS
    unknown = [s for s in samplers if s not in known]
    if unknown:
        raise bad_request(f"unknown sampler(s) {unknown}: known are {list(known)}", "samplers")
    asked = req.n_predict if req.n_predict is not None else req.max_tokens
    if asked is not None and asked < -1:
        raise bad_request(f"n_predict must be -1 (until the end), 0 (cache the prompt) or more, got {asked}",
                          "n_predict")
    wanted = room if asked in (None, -1) else min(asked, room)
    seed = None if req.seed in RANDOM_SEEDS else req.seed
    if seed is not None and not (-(2**63) <= seed < 2**64):
        raise bad_request("seed must fit in 64 bits", "seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    penalties = infill_penalties(req, samplers)
    try:
        params = SamplingParams(
            temperature=float(req.temperature) if "temperature" in samplers else 1.0,
            top_k=req.top_k if "top_k" in samplers and req.top_k > 0 else 0,
            top_p=float(req.top_p) if "top_p" in samplers and 0 < req.top_p < 1 else 1.0,
            min_p=float(req.min_p) if "min_p" in samplers and 0 < req.min_p < 1 else 0.0,
            max_tokens=max(1, wanted), stop=tuple(stop), seed=seed, ignore_eos=req.ignore_eos, **penalties)
    except ConfigError as exc:
        raise bad_request(str(exc)) from exc
    return params, [s for s in samplers if s in UNAPPLIED_SAMPLERS], wanted


def infill_penalties(req: InfillRequest, samplers: list[str]) -> dict[str, Any]:
    """llama-server's penalties sampler (only when "penalties" is in the chain) and logit_bias as SamplingParams
    fields; presence and frequency count the whole output (OpenAI's definition; llama-server counts the last
    repeat_last_n tokens): docs/infill.md."""
    options: dict[str, Any] = {}
    if "penalties" in samplers:
        options = checked_penalties(req.presence_penalty, req.frequency_penalty, req.repeat_penalty,
                                    req.repeat_last_n, "repeat_penalty")
    bias = req.logit_bias
    if isinstance(bias, list):
        for pair in bias:
            if len(pair) != 2 or isinstance(pair[0], bool) or not isinstance(pair[0], int):
                raise bad_request(f"logit_bias pairs are [token id, bias or false], got {pair}", "logit_bias")
    items = list(bias.items()) if isinstance(bias, dict) else [(str(t), b) for t, b in (bias or [])]
    # false bans a token (its logit -inf, as llama-server does); true is ignored, as llama-server ignores it.
    banned = [token for token, value in items if value is False]
    pairs = logit_bias_pairs({token: float(value) for token, value in items if not isinstance(value, bool)})
    bans = logit_bias_pairs({token: 0.0 for token in banned})
    if {t for t, _ in pairs} & {t for t, _ in bans}:
        raise bad_request("logit_bias names a token id twice", "logit_bias")
    options["logit_bias"] = tuple(sorted(pairs + tuple((t, float("-inf")) for t, _ in bans)))
    return options


# --------------------------------------------------------------------------------------------- prompts


def _require_fim(state: Any) -> None:
    tokens = state.decoder.fim_tokens
    if not tokens.supported:
        raise APIError(400, tokens.unsupported_message().strip() + " Use a FIM model (Qwen2.5-Coder, StarCoder2, "
                       "CodeLlama, DeepSeek-Coder, ...).", code="fim_not_supported")


async def fim_prompt_ids(state: Any, prompt, suffix: str, params: SamplingParams) -> list[int]:
    """/v1/completions with a suffix: the FIM prompt of prompt (the text before) and suffix, all of both kept (a
    prompt that cannot fit is a 400, never cut silently)."""
    if not isinstance(prompt, str):
        raise bad_request("a suffix needs the prompt as text (the code before the insertion point)", "prompt")
    _require_fim(state)
    check_prompt_chars(len(prompt) + len(suffix), state.engine.target.max_context, "prompt")
    built = await state.prepare(len(prompt) + len(suffix), state.decoder.encode_infill, prompt, suffix, "", (), None)
    return built.ids


def infill_window(context: int) -> InfillWindow:
    """The window of every /infill prompt on a `context`-token server. Like llama-server's it depends on no
    request field, so a warm-up (n_predict 0) lays out the same tokens as the completions after it."""
    return InfillWindow(batch=min(FIM_BATCH, context // 2), context=context, predict=INFILL_RESERVE)


# --------------------------------------------------------------------------------------------- the route


def register_infill(app: FastAPI, state: Any) -> None:
    @app.post("/infill", responses=error_responses(400, 404))
    async def infill(req: InfillRequest, request: Request):
        state.require_ready()
        model = state.check_model(req.model)
        _require_fim(state)
        if not 1 <= req.n_cmpl <= MAX_COMPLETIONS:
            raise bad_request(f"n_cmpl must be between 1 and {MAX_COMPLETIONS}, got {req.n_cmpl}", "n_cmpl")
        if req.stream and req.n_cmpl > 1:
            raise unsupported("n_cmpl", "only one completion when streaming")
        extra = [ExtraChunk(c.text, c.filename) for c in req.input_extra]
        chars = (len(req.input_prefix) + len(req.input_suffix) + len(req.prompt)
                 + sum(len(c.text) + len(c.filename) for c in extra))
        check_prompt_chars(chars, state.engine.target.max_context, "input_extra" if extra else "input_prefix")
        context = state.engine.target.max_context
        infill_sampling(req, context)  # the options checked before any tokenizing
        built: InfillPrompt = await state.prepare(chars, state.decoder.encode_infill, req.input_prefix,
                                                  req.input_suffix, req.prompt, extra, infill_window(context))
        room = max(1, context - len(built.ids))
        params, unapplied, wanted = infill_sampling(req, room)
        check_fits(state, built.ids, params, "input_prefix")
        settings = _generation_settings(req, params, unapplied, context)
        jobs = []
        for index in range(req.n_cmpl):
            seeded = params if params.seed is None or index == 0 else _reseeded(params, params.seed + index)
            jobs.append(submit(state, built.ids, seeded, req, request))
        reply = InfillReply(state, model, built, settings, req, wanted)
        if req.stream:
            return JobStreamingResponse(reply.stream(jobs[0]), jobs[0])
        bodies = await asyncio.gather(*(reply.collect(job, request, index) for index, job in enumerate(jobs)))
        return JSONResponse(bodies[0] if len(bodies) == 1 else list(bodies))


def _reseeded(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed % 2**64)


def _generation_settings(req: InfillRequest, params: SamplingParams, unapplied: list[str], context: int) -> dict:
    return {"n_ctx": context, "n_predict": req.n_predict if req.n_predict is not None else -1,
            "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
            "seed": params.seed if params.seed is not None else -1, "stop": list(params.stop), "stream": req.stream,
            "n_indent": req.n_indent, "t_max_predict_ms": req.t_max_predict_ms, "ignore_eos": params.ignore_eos,
            "samplers": [s for s in (req.samplers or DEFAULT_SAMPLERS) if s in APPLIED_SAMPLERS],
            "samplers_not_applied": unapplied}
