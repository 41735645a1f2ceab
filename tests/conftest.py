"""Tiny random-weight models built in the test process (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdec.backends.pytorch.backend import TransformersBackend

VOCAB = 97

# Tiny models run fastest on one thread, and on a shared 2-core machine several intra-op threads per
# process oversubscribe the CPU (a 3-layer forward goes from ~2 ms to ~200 ms under load).
torch.set_num_threads(1)


def tiny_qwen2(seed: int, layers: int = 2, hidden: int = 64, vocab: int = VOCAB) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=3,
        bos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    # Larger weights give peaked, well-separated logits, so argmax is not decided by rounding.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def tiny_llama(seed: int, vocab: int = VOCAB) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=3, bos_token_id=1,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def target_model():
    return tiny_qwen2(seed=0, layers=3)


@pytest.fixture(scope="session")
def draft_model():
    return tiny_qwen2(seed=1, layers=1)


@pytest.fixture()
def target_backend(target_model):
    return TransformersBackend(target_model, name="tiny-target", max_context=256)


@pytest.fixture()
def draft_backend(draft_model):
    return TransformersBackend(draft_model, name="tiny-draft", max_context=256)


def tiny_tokenizer(vocab: int = VOCAB, word: str = "w"):
    """A word-level PreTrainedTokenizerFast over `vocab` ids ("<pad>", "<s>", "<unk>", "</s>", then w4, w5, ...).

    Built in memory from the `tokenizers` library (no downloads); `word` changes every token string,
    which gives a tokenizer with the same size but a different vocabulary. Save it next to a Llama model:
    AutoTokenizer forces Qwen2Tokenizer on qwen2 directories, which mangles a word-level vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<unk>", "</s>"]
    table = {tok: i for i, tok in enumerate(specials)}
    table.update({f"{word}{i}": i for i in range(len(specials), vocab)})
    core = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def save_tiny_model(path, model, tokenizer=None):
    """save_pretrained a tiny model (and tokenizer) into path; returns str(path) for load_backend/CLI use."""
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


def assert_cache_keeps(engine, prompt, tokens) -> None:
    """After a request the engine's target cache holds prompt + generated tokens minus the last, for reuse by
    the next request (empty when the engine does not reuse prefixes), and its record says so."""
    expected = (list(prompt) + list(tokens))[:-1] if engine.reuses_prefix else []
    assert engine.retained.tokens == expected
    assert engine.cache.length == len(expected)
    drafter = getattr(engine.drafter, "model", engine.drafter)  # hybrid: its draft model
    if getattr(drafter, "cache", None) is not None:
        assert drafter.cache.length == len(drafter.retained.tokens)


@pytest.fixture(autouse=True, scope="session")
def _measurements_in_a_temporary_directory(tmp_path_factory):
    """Curves and probe verdicts measured on tiny test models go to a directory of the test session, not the user's
    cache: in this process and in the servers and CLIs the tests start (they inherit the environment)."""
    path = tmp_path_factory.mktemp("measurements")
    original = os.environ.get("SPECDEC_MEASUREMENTS")
    os.environ["SPECDEC_MEASUREMENTS"] = str(path)
    yield path
    if original is None:
        os.environ.pop("SPECDEC_MEASUREMENTS", None)
    else:
        os.environ["SPECDEC_MEASUREMENTS"] = original


def greedy_reference(model):
    """transformers' own greedy generate of `model`, memoised: the independent reference of greedy tests."""
    cache = {}

    def run(prompt, n):
        key = (tuple(prompt), n)
        if key not in cache:
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
            )
            cache[key] = out[0, len(prompt):].tolist()
            assert len(cache[key]) == n, "the reference stopped early; pick a prompt without EOS"
        return cache[key]

    return run


def install_fake_llama_server(tmp_path, source: str):
    """A `bin/` folder under tmp_path whose llama-server is the Python `source` (an executable script)."""
    import stat
    import sys

    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "llama-server"
    script.write_text(f"#!{sys.executable}\n" + source)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder

