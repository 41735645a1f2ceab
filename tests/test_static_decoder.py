"""The static decoder (fixed KV buffers, row buckets, CUDA graphs) against transformers' own forward and eager greedy decoding.

CPU tests run the same code eagerly (with padding to buckets and chunked prefill forced on); tests
marked gpu run it with CUDA graphs: `python -m pytest -m gpu tests/test_static_decoder.py tests/test_verify.py`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

from conftest import VOCAB, tiny_llama, tiny_qwen2
from specdec.backends.kvcache import ContextOverflowError
from specdec.backends.pytorch.backend import TransformersBackend
from specdec.backends.pytorch.static_decoder import static_support
from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import create_drafter
from specdec.engine.single import SpeculativeEngine, plain_engine

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tiny_qwen3(seed: int = 5):
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    return Qwen3ForCausalLM(config).eval()


MAKERS = {"qwen2": lambda: tiny_qwen2(0, layers=3), "llama": lambda: tiny_llama(0), "qwen3": tiny_qwen3}


def _pair(make, device="cpu", dtype=torch.float32, **static_kwargs):
    """The same weights twice: one behind transformers' forward, one behind the static decoder."""
    eager = TransformersBackend(make().to(device, dtype), max_context=256, static=False)
    static = TransformersBackend(make().to(device, dtype), max_context=256, static=True, **static_kwargs)
    return eager, static


def _replay_against_eager(eager, static, steps, seed=0, atol=1e-4):
    """Feed both backends the same passes (prefill, verifications, rollbacks); compare every logit."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (200,), generator=generator).tolist()
    eager_cache, static_cache = eager.new_cache(256), static.new_cache(256)
    at = 0
    worst = 0.0
    for rows, logits_wanted, rollback in steps:
        expected = eager.forward(ids[at : at + rows], eager_cache, logits_wanted)
        got = static.forward(ids[at : at + rows], static_cache, logits_wanted)
        assert got.shape == expected.shape == (logits_wanted, VOCAB)
        assert got.dtype == torch.float32
        worst = max(worst, float((got.cpu() - expected.cpu()).abs().max()))
        at += rows - rollback
        eager_cache.trim(rollback)
        static_cache.trim(rollback)
        assert static_cache.length == eager_cache.length == at
    assert worst < atol, worst
    return worst


STEPS = [(30, 30, 0), (5, 5, 2), (1, 1, 0), (9, 9, 7), (3, 2, 0), (17, 1, 4), (1, 1, 1), (40, 3, 0)]


@pytest.mark.parametrize("arch", sorted(MAKERS))
def test_static_logits_equal_transformers_forward(arch):
    eager, static = _pair(MAKERS[arch])
    _replay_against_eager(eager, static, STEPS)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_compiled_layers_equal_transformers_forward(arch):
    """Each layer through torch.compile (the CUDA default), padded to buckets, against transformers' forward."""
    eager, static = _pair(MAKERS[arch], pad_to_buckets=True, compile_layers=True)
    _replay_against_eager(eager, static, STEPS)
    assert static.decoder.compile_layers and static.decoder.compile_failure is None
    assert "compiled layers" in static.runtime


def test_a_failed_compile_falls_back_to_eager_layers(monkeypatch, capsys):
    """Negative control: a compile that raises is reported, and the eager layers give the same logits."""
    from specdec.backends.pytorch import static_decoder

    def broken(function):
        def fails(*args, **kwargs):
            raise RuntimeError("no C++ compiler here")
        return fails

    monkeypatch.setattr(static_decoder, "_compiled", broken)
    eager, static = _pair(MAKERS["qwen2"], pad_to_buckets=True, compile_layers=True)
    static.new_cache(64)
    assert not static.decoder.compile_layers
    assert "no C++ compiler here" in static.decoder.compile_failure and "compile failed" in static.runtime
    assert "torch.compile of the layers failed" in capsys.readouterr().err
    _replay_against_eager(eager, static, STEPS)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_padding_to_buckets_and_chunked_prefill_change_nothing(arch):
    """Padding rows sit after the real ones and are masked out; a 40-row input runs as 8-row chunks."""
    eager, static = _pair(MAKERS[arch], buckets=(1, 2, 4, 8), pad_to_buckets=True)
    _replay_against_eager(eager, static, STEPS)
    assert set(static.decoder.passes) <= {1, 2, 4, 8} and static.decoder.passes[8] >= 5


def test_negative_control_a_broken_mask_is_caught():
    """If padding rows were visible (mask off by one bucket), the comparison must fail."""
    eager, static = _pair(MAKERS["qwen2"], buckets=(1, 2, 4, 8), pad_to_buckets=True)
    static.decoder.slot_index = static.decoder.slot_index - 3  # every row sees 3 slots past its position
    with pytest.raises(AssertionError):
        _replay_against_eager(eager, static, STEPS)


def test_weights_are_shared_not_copied():
    model = tiny_qwen2(0, layers=2)
    before = sum(p.numel() for p in model.parameters())
    reference = tiny_qwen2(0, layers=2)
    backend = TransformersBackend(model, max_context=64, static=True)
    attn = model.model.layers[0].self_attn
    fused = backend.decoder.layers[0].qkv
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before
    # transformers' own forward still works on the re-pointed parameters and gives the same logits
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-6)


def test_static_cache_rolls_back_and_refuses_overflow():
    backend = TransformersBackend(tiny_qwen2(0, layers=1), max_context=64, static=True)
    cache = backend.new_cache(32)
    backend.forward(list(range(4, 34)), cache, 1)
    assert cache.length == 30
    with pytest.raises(ContextOverflowError):
        backend.forward([5, 6, 7], cache, 1)
    assert cache.length == 30
    assert cache.trim(100) == 30 and cache.length == 0


def test_unsupported_models_fall_back_or_refuse():
    torch.manual_seed(0)
    windowed = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                sliding_window=16))
    assert "sliding" in static_support(windowed)
    assert TransformersBackend(windowed, max_context=64).decoder is None  # auto on CPU: eager
    with pytest.raises(ValueError, match="sliding"):
        TransformersBackend(windowed, max_context=64, static=True)
    # on CPU the eager path stays the default even for supported models
    assert TransformersBackend(tiny_qwen2(0, layers=1), max_context=64).decoder is None


def _greedy(engine, prompt, n=40):
    return engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)).tokens


@pytest.mark.parametrize("drafter", ["draft_model", "prompt_lookup"])
def test_speculative_greedy_on_the_static_path_equals_eager_plain(drafter):
    eager = TransformersBackend(tiny_qwen2(0, layers=3), max_context=256, static=False)
    target = TransformersBackend(tiny_qwen2(0, layers=3), max_context=256, static=True, buckets=(1, 2, 4, 8),
                                 pad_to_buckets=True)
    draft = TransformersBackend(tiny_qwen2(1, layers=1), max_context=256, static=True, buckets=(1, 2, 4, 8),
                                pad_to_buckets=True)
    spec = SpecConfig(6, drafter=drafter, k_policy="adaptive")
    engine = SpeculativeEngine(target, create_drafter(drafter, draft_backend=draft, spec=spec), spec)
    for prompt in ([1, 5, 9, 5, 9, 5], [7] * 12, list(range(4, 60))):
        assert _greedy(engine, prompt) == _greedy(plain_engine(eager), prompt)
    assert engine.total_stats.num_draft_tokens > 0


def test_dummy_model_follows_its_successor_rule():
    from specdec.bench.gpu.dummy import build_dummy_model, dummy_prompts, successor_table

    successor = successor_table(vocab=512)
    model = build_dummy_model("tiny", "cpu", torch.bfloat16, successor, vocab=512, max_positions=512)
    backend = TransformersBackend(model, max_context=256, static=True)
    kind, prompt = dummy_prompts(successor, 1, 40)[0]
    assert kind == "copy"
    out = _greedy(plain_engine(backend), prompt, 30)
    chain = [prompt[-1]]
    for _ in range(30):
        chain.append(int(successor[chain[-1]]))
    assert out == chain[1:]
    assert out[:10] == prompt[prompt.index(prompt[-1]) + 1 :][:10]  # the prompt holds what the output repeats


# ----- on a GPU: the same checks with CUDA graphs ----------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", sorted(MAKERS))
def test_cuda_graph_logits_equal_transformers_forward_fp32(arch):
    eager, static = _pair(MAKERS[arch], device="cuda")
    assert static.decoder.use_graphs and static.decoder.compile_layers  # the CUDA defaults
    _replay_against_eager(eager, static, STEPS, atol=1e-3)
    assert static.decoder.graph_failure is None and static.decoder.compile_failure is None
    # a new cache after the first one (and its graphs) was freed: captured into its own memory pool
    assert set(static.new_cache(64).graphs) == set(static.decoder.buckets)
    assert static.decoder.graph_failure is None


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_greedy_equals_transformers_eager_greedy_fp32():
    """Our engine on CUDA graphs (plain, draft model, prompt lookup) vs transformers' generate, fp32, eager."""
    from specdec.bench.method.hf_peer import hf_generate

    model = tiny_qwen2(0, layers=3).cuda()
    reference_model = tiny_qwen2(0, layers=3).cuda()
    target = TransformersBackend(model, max_context=256)
    draft = TransformersBackend(tiny_qwen2(1, layers=1).cuda(), max_context=256)
    assert target.decoder is not None and target.decoder.use_graphs  # the CUDA default
    assert target.decoder.compile_layers  # the CUDA default too
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    engines = [plain_engine(target)]
    for drafter in ("draft_model", "prompt_lookup"):
        spec = SpecConfig(8, drafter=drafter, k_policy="adaptive")
        engines.append(SpeculativeEngine(target, create_drafter(drafter, draft_backend=draft, spec=spec), spec))
    for prompt in ([1, 5, 9, 5, 9, 5], [7] * 12, list(range(4, 90))):
        expected = hf_generate(reference_model, prompt, params, ()).tokens
        for engine in engines:
            assert engine.generate(prompt, params).tokens == expected
    assert target.pass_costs is not None  # the adaptive engines calibrated the CUDA-graph target


@pytest.mark.gpu
@needs_cuda
def test_cuda_sampling_uses_a_cuda_generator_and_is_seeded():
    from specdec.core.sampling import make_generator, sample_token

    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0], device="cuda")
    draws = [[sample_token(probs, g) for _ in range(300)] for g in (make_generator(3, "cuda"), make_generator(3, "cuda"))]
    assert draws[0] == draws[1] and set(draws[0]) == {1, 3, 4}


@pytest.mark.gpu
@needs_cuda
def test_cuda_sampled_engine_follows_the_target_distribution():
    """Speculative sampling on CUDA graphs: the first two tokens jointly follow the target (chi-square)."""
    import numpy as np

    from test_engine import chi_square_p

    vocab = 6
    target_model = tiny_qwen2(3, layers=2, vocab=vocab).cuda()
    draft_model = tiny_qwen2(4, layers=1, vocab=vocab).cuda()
    with torch.no_grad():  # soften the tiny models so every continuation has real mass
        target_model.lm_head.weight.mul_(0.05)
        draft_model.lm_head.weight.mul_(0.05)
    # Eager layers in the graphs: this test is about sampling, and a compile per model costs seconds.
    target = TransformersBackend(target_model, max_context=64, compile_layers=False)
    draft = TransformersBackend(draft_model, max_context=64, compile_layers=False)
    prompt = [1, 2, 4]
    with torch.no_grad():
        first = torch.softmax(target_model(torch.tensor([prompt], device="cuda")).logits[0, -1].double(), -1)
        seconds = torch.stack([
            torch.softmax(target_model(torch.tensor([prompt + [t]], device="cuda")).logits[0, -1].double(), -1)
            for t in range(vocab)])
    exact = (first[:, None] * seconds).reshape(-1).cpu().numpy()
    spec = SpecConfig(3, drafter="draft_model", k_policy="fixed")
    engine = SpeculativeEngine(target, create_drafter("draft_model", draft_backend=draft, spec=spec), spec)
    counts = np.zeros(vocab * vocab)
    draws = 3000
    for seed in range(draws):
        tokens = engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=2, seed=seed, ignore_eos=True)).tokens
        counts[tokens[0] * vocab + tokens[1]] += 1
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, (p_value, tv)
    assert 0.0 < engine.total_stats.acceptance_rate < 1.0
