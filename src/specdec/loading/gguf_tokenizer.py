"""A transformers tokenizer (vocabulary, merges, special tokens, chat template) read from a GGUF file, converted once and cached.

Both runtimes then see the very same token ids: the torch backend and the llama.cpp backend encode
prompts with this tokenizer, and llama.cpp only ever receives ids. Converting a 150k-token GGUF
vocabulary takes ~15 s and ~0.8 GB, so it runs once in a child process (the parent's peak memory
stays that of inference) and the result is saved under the specdec cache directory, keyed by the
file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path


class TokenizerBuildError(RuntimeError):
    """The GGUF's tokenizer could not be converted; the message says why."""


def cached_tokenizer_dir(gguf_path: Path, cache_root: Path) -> Path:
    """Where the converted tokenizer of this exact file lives."""
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root / "tokenizers" / f"{gguf_path.stem}-{key}"


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Build the tokenizer from the GGUF's metadata with transformers and save it (in this process)."""
    from transformers import AutoTokenizer  # slow to import: here, not at CLI start

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    partial = out_dir.with_name(out_dir.name + ".partial")
    tokenizer.save_pretrained(partial)
    shutil.rmtree(out_dir, ignore_errors=True)  # a half-written copy from an interrupted run
    os.replace(partial, out_dir)


def load_gguf_tokenizer(gguf_path: str | os.PathLike, cache_root: Path):
    """The GGUF's tokenizer, converting it in a child process the first time."""
    from transformers import AutoTokenizer  # slow to import: here, not at CLI start

    gguf_path = Path(gguf_path)
    out_dir = cached_tokenizer_dir(gguf_path, cache_root)
    if not (out_dir / "tokenizer_config.json").exists():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        print(f"specdec: reading the tokenizer of {gguf_path.name} (once; cached in {out_dir.parent})",
              file=sys.stderr, flush=True)
        result = subprocess.run(
            [sys.executable, "-m", "specdec.loading.gguf_tokenizer", str(gguf_path), str(out_dir)],
            capture_output=True, text=True,
        )
        if result.returncode != 0 or not (out_dir / "tokenizer_config.json").exists():
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise TokenizerBuildError(f"could not read the tokenizer of {gguf_path}: {last}")
    return AutoTokenizer.from_pretrained(str(out_dir))


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
