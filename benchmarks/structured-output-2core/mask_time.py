"""Mask time per token of llguidance (the engine specdec uses) on BFCL's function schemas, over the default target's
vocabulary: for each function, its parameter schema compiled, then an accepted answer's arguments walked token by
token, a full-vocabulary mask computed at every position (what one verified row costs), and how many of those tokens
the grammar forced. Optionally xgrammar on the same walk (--xgrammar, if installed), for the choice in
docs/structured-output.md. One process, one thing timed at a time.

    python benchmarks/structured-output-2core/mask_time.py --limit 60 [--xgrammar]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.torch

from specdec.host.paths import cache_dir
from specdec.loading.gguf_tokenizer import load_gguf_tokenizer

BFCL = Path(__file__).resolve().parents[3] / "shared" / "data" / "bfcl"
OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def schemas(limit: int):
    """(schema, arguments) per simple_python problem: the function's parameters as a JSON schema, and the first
    accepted value of each argument (the empty string meaning 'may be left out' skipped)."""
    problems = [json.loads(line) for line in (BFCL / "BFCL_v4_simple_python.json").open()]
    answers = {json.loads(line)["id"]: json.loads(line) for line in
               (BFCL / "possible_answer" / "BFCL_v4_simple_python.json").open()}
    for problem in problems[:limit]:
        function = problem["function"][0]
        schema = json.loads(json.dumps(function["parameters"]).replace('"dict"', '"object"')
                            .replace('"float"', '"number"').replace('"tuple"', '"array"').replace('"any"', '"string"'))
        truth = answers[problem["id"]]["ground_truth"][0][function["name"]]
        args = {}
        for name in schema.get("properties", {}):
            values = [v for v in truth.get(name, [""]) if v != ""]
            if values:
                args[name] = values[0]
        yield schema, args


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--xgrammar", action="store_true")
    args = parser.parse_args()
    gguf = cache_dir() / "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
    hf = load_gguf_tokenizer(gguf, cache_dir())
    vocab = 151936
    began = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    print(f"llguidance tokenizer: {time.perf_counter() - began:.2f} s for {vocab} ids")
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    compile_ms, mask_us, forced, walked, skipped = [], [], 0, 0, 0
    for schema, arguments in schemas(args.limit):
        text = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
        began = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=OPTIONS)
        matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
        if matcher.is_error():
            skipped += 1
            continue
        compile_ms.append((time.perf_counter() - began) * 1e3)
        tokens = hf.encode(text, add_special_tokens=False)
        if matcher.validate_tokens(tokens) != len(tokens):
            skipped += 1  # an answer the schema's compact form does not accept (e.g. key order); not timed
            continue
        position = 0
        while position < len(tokens):
            ff = matcher.compute_ff_tokens()
            if ff and tokens[position:position + len(ff)] == ff:
                matcher.consume_tokens(ff)
                forced += len(ff)
                position += len(ff)
                walked += len(ff)
                continue
            began = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            mask_us.append((time.perf_counter() - began) * 1e6)
            matcher.consume_token(tokens[position])
            position += 1
            walked += 1
    q = statistics.quantiles(mask_us, n=20)
    print(f"llguidance: {len(compile_ms)} schemas ({skipped} skipped), compile median {statistics.median(compile_ms):.2f} ms "
          f"max {max(compile_ms):.1f} ms; mask per token median {statistics.median(mask_us):.0f} us, p95 {q[-1]:.0f} us, "
          f"max {max(mask_us):.0f} us over {len(mask_us)} masks; forced {forced}/{walked} tokens = {forced / walked:.2f}")
    if args.xgrammar:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        compiler = xgrammar.GrammarCompiler(info)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        compile_ms, mask_us = [], []
        for schema, arguments in schemas(args.limit):
            text = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
            began = time.perf_counter()
            try:
                compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            except Exception:  # noqa: BLE001 - a schema xgrammar refuses is counted, not timed
                continue
            compile_ms.append((time.perf_counter() - began) * 1e3)
            matcher = xgrammar.GrammarMatcher(compiled)
            for token in hf.encode(text, add_special_tokens=False):
                began = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                mask_us.append((time.perf_counter() - began) * 1e6)
                if not matcher.accept_token(token):
                    break
        q = statistics.quantiles(mask_us, n=20)
        print(f"xgrammar: {len(compile_ms)} schemas, compile median {statistics.median(compile_ms):.2f} ms max "
              f"{max(compile_ms):.1f} ms; mask per token median {statistics.median(mask_us):.0f} us, p95 {q[-1]:.0f} us "
              f"over {len(mask_us)} masks")


if __name__ == "__main__":
    main()
