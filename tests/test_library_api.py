"""The public `specdec.load`: which draft it pairs with a target and which drafter it uses without one."""

from __future__ import annotations


def test_a_target_of_ones_own_gets_no_packaged_draft_and_drafts_with_the_suffix_drafter(monkeypatch):
    import torch

    import specdec
    from markov_backend import MarkovBackend
    from specdec.decoder import SpecDecoder

    seen = {}

    def fake_load(cls, ref=None, spec=None):
        seen["draft"] = ref.draft
        return SpecDecoder(MarkovBackend(torch.zeros(4, 4)), None, spec)

    monkeypatch.setattr(SpecDecoder, "load", classmethod(fake_load))
    decoder = specdec.load("my-model.gguf")
    assert seen["draft"] is None and decoder.spec.drafter == "suffix" and decoder.spec.k_policy == "adaptive"
    specdec.load()
    assert seen["draft"] == "default"  # the packaged pair stays a pair
    specdec.load("my-model.gguf", draft="default")
    assert seen["draft"] == "default"  # asked for
