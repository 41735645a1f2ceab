"""`specdec bench --device cuda` / `--load-format dummy`: build or load the pair on the device, make the prompts, run bench/gpu/run.py and write its report."""

from __future__ import annotations

import argparse
import sys

import torch

from specdec.backends.pytorch.backend import TransformersBackend
from specdec.bench.datasets import select_prompts
from specdec.bench.gpu.dummy import SHAPES, build_dummy_model, dummy_prompts, successor_table
from specdec.bench.gpu.report import to_markdown, write
from specdec.bench.gpu.run import DEFAULT_GPU_METHODS, GPU_METHODS, GpuBench, GpuBenchConfig
from specdec.cli.flags import model_ref_from_args
from specdec.config import ConfigError
from specdec.decoder import SpecDecoder
from specdec.loading.models import torch_device, uses_cuda

LOAD_FORMATS = ("auto", "dummy")


def add_gpu_arguments(bench: argparse.ArgumentParser) -> None:
    group = bench.add_argument_group("GPU bench (with --device cuda or --load-format dummy)")
    group.add_argument(
        "--load-format", choices=LOAD_FORMATS, default="auto",
        help="dummy: random weights of a real shape made on the device (vLLM's --load-format dummy), with a successor "
        "rule so drafts can be accepted; see docs/gpu.md. auto: load the models given",
    )
    group.add_argument("--dummy-target", default="qwen2.5-7b", choices=sorted(SHAPES),
                       help="shape of the dummy target (default qwen2.5-7b)")
    group.add_argument("--dummy-draft", default="qwen2.5-0.5b", choices=sorted(SHAPES) + ["none"],
                       help="shape of the dummy draft, or none (default qwen2.5-0.5b)")
    group.add_argument("--prompt-tokens", type=int, default=300, help="dummy prompt length (default 300)")
    group.add_argument("--num-prompts", type=int, default=4,
                       help="dummy prompts, half holding the text the output repeats (default 4)")
    group.add_argument("--gpu-methods", default=",".join(DEFAULT_GPU_METHODS),
                       help=f"comma-separated, from {', '.join(GPU_METHODS)} (default: all but hf_static, whose "
                       "torch.compile takes minutes)")
    group.add_argument("--time-budget", type=float, default=None,
                       help="seconds: methods not started by then are skipped and reported (default: none)")
    group.add_argument("--lookup-k-max", type=int, default=32,
                       help="largest k of prompt lookup's adaptive policy (default 32: on a GPU rows are nearly free)")
    group.add_argument("--draft-k-max", type=int, default=16,
                       help="largest k of the draft model's adaptive policy (default 16)")
    group.add_argument("--fp32", action="store_true", help="dummy models in fp32 instead of bf16")
    group.add_argument("--compile-layers", choices=("auto", "on", "off"), default="auto",
                       help="torch.compile each layer's element-wise work (auto: with CUDA graphs); when on, the "
                       "bench also times the passes with eager layers for comparison")


def wants_gpu_bench(args: argparse.Namespace) -> bool:
    """The GPU bench for dummy weights, --device cuda, or --device auto on a machine with CUDA (torch backend)."""
    device = str(getattr(args, "device", "auto"))
    if args.load_format == "dummy" or device.startswith("cuda"):
        return True
    return getattr(args, "backend", "auto") != "llama.cpp" and uses_cuda(device)


def parse_gpu_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in GPU_METHODS]
    if unknown or not methods:
        raise ConfigError(f"--gpu-methods: unknown {unknown or 'empty list'}; choose from {', '.join(GPU_METHODS)}")
    return methods


def run_gpu_bench_command(args: argparse.Namespace) -> int:
    methods = parse_gpu_methods(args.gpu_methods)
    if args.prompt_tokens < 8 or args.num_prompts < 1:
        raise ConfigError("--prompt-tokens must be >= 8 and --num-prompts >= 1")
    if not (1 <= args.lookup_k_max <= 63 and 1 <= args.draft_k_max <= 63):
        raise ConfigError("--lookup-k-max and --draft-k-max must be in [1, 63] (a verification is at most 64 rows)")
    device = torch_device(args.device)
    compile_layers = {"auto": None, "on": True, "off": False}[args.compile_layers]
    config = GpuBenchConfig(methods=methods, max_tokens=args.max_tokens, k_max=args.lookup_k_max,
                            draft_k_max=args.draft_k_max, time_budget=args.time_budget)
    if args.load_format == "dummy":
        dtype = torch.float32 if args.fp32 else torch.bfloat16
        context = args.prompt_tokens + args.max_tokens + 64
        successor = successor_table()
        print(f"building dummy {args.dummy_target} (draft {args.dummy_draft}) on {device}", file=sys.stderr, flush=True)
        target = TransformersBackend(build_dummy_model(args.dummy_target, device, dtype, successor, seed=1),
                                     name=f"dummy {args.dummy_target}", max_context=context, static=True,
                                     compile_layers=compile_layers)
        draft = None
        if args.dummy_draft != "none":
            draft = TransformersBackend(build_dummy_model(args.dummy_draft, device, dtype, successor, seed=2),
                                        name=f"dummy {args.dummy_draft}", max_context=context, static=True,
                                        compile_layers=compile_layers)
        prompts = dummy_prompts(successor, args.num_prompts, args.prompt_tokens)
        config.extra = {"target": f"dummy {args.dummy_target}", "draft": None if draft is None else f"dummy {args.dummy_draft}",
                        "load_format": "dummy", "dtype": str(dtype).replace("torch.", ""),
                        "prompt_tokens": args.prompt_tokens, "prompts": len(prompts)}
    else:
        ref = model_ref_from_args(args)
        decoder = SpecDecoder.load(ref)
        target, draft = decoder.target, decoder.draft
        if getattr(target, "model", None) is None:
            raise ConfigError("the GPU bench runs transformers models (the torch backend)")
        for backend in (target, draft):
            if compile_layers is not None and getattr(backend, "decoder", None) is not None:
                backend.decoder.set_layers_compiled(compile_layers)
        chosen = select_prompts(args.tasks, getattr(args, "prompts", None), args.limit)
        prompts = [(p.task, decoder.encode(p.text, chat=args.chat)) for p in chosen]
        config.extra = {"target": ref.target, "draft": ref.draft, "load_format": "auto", "dtype": ref.weight_format,
                        "prompt_tokens": round(sum(len(p) for _, p in prompts) / len(prompts)), "prompts": len(prompts)}
    config.extra.update(max_tokens=args.max_tokens, k_max=config.k_max, draft_k_max=config.draft_k_max,
                        argv=sys.argv[1:])
    results = GpuBench(target, draft, prompts, config).run()
    paths = write(results, args.out)
    print(to_markdown(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


__all__ = ["add_gpu_arguments", "run_gpu_bench_command", "wants_gpu_bench"]
