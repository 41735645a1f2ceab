"""The systems a serving bench can run, by name: ours, ours on exact kernels, llama-server, and the solo reference."""

from __future__ import annotations

REFERENCE = "reference"
SYSTEMS = {
    "ours": "specdec serve --parallel C (default drafter and kernels)",
    "ours_exact": "specdec serve --exact --parallel C (every stream must equal the reference)",
    "ours_serial": "specdec serve --parallel 1 at every concurrency (today's one-at-a-time server)",
    "llamacpp_plain": "llama-server -np C",
    "llamacpp_ngram": "llama-server -np C --spec-type ngram-simple",
}
REFERENCE_DESCRIPTION = "specdec serve --drafter none --exact, concurrency 1 (plain decoding, solo)"
LLAMACPP_SYSTEMS = ("llamacpp_plain", "llamacpp_ngram")
