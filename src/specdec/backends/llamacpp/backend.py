"""ModelBackend over llama.cpp (llama-cpp-python's low-level API): GGUF weights as they are, one KV sequence per cache.

Each backend owns one llama.cpp model and one context whose KV memory is shared by its caches; a
cache is a llama.cpp sequence id plus a length, and trim(n) is `llama_memory_seq_rm` of the tail,
so rollback copies nothing. A forward is one `llama_decode` with logits requested only for the rows
the caller asked for. `forward_batch` (the seam of backends/base.py) puts many sequences' rows in one
flat `llama_batch`, each row tagged with its sequence id, logits only for the rows wanted.

KV memory: `parallel` sequences may decode at once, each up to max_context tokens. By default the
memory is one unified buffer (llama.cpp's kv_unified) of parallel x max_context cells that any of
`max_sequences` sequence ids may use (parallel = 1: what a single-stream engine has always had, 16
ids in max_context cells). Exact mode with parallel > 1 gives each sequence id a KV stream of its own
(kv_unified off: max_sequences streams of max_context cells; max_sequences defaults to parallel).

Two modes. Fast (batch_invariant=False, the default of `specdec generate`/`serve`): llama.cpp's own
CPU configuration: repacked weights (and AMX where the library has it and a multi-row pass was proven
to run, probe.py), flash attention as llama.cpp chooses, every pass in one llama_decode.
Lossless in distribution; a row can round differently in a batch than alone, so greedy output can
differ from plain decoding at near-ties. Exact (batch_invariant=True, `--exact`): a row's logits are
bit-identical whether it is decoded alone (plain decoding) or as one row of a k+1 verification batch.
llama.cpp picks kernels by batch size in four places, so the exact mode avoids each:
- repacked weights (CPU "extra buffer types": interleaved gemm for each group of 4 rows, gemv for
  the rest, so passes of 1-3 rows all take the gemv): kept, and rows whose logits are returned go
  through llama_decode in slices of at most EXACT_REPACKED_ROWS rows. Where the library has AMX, its
  buffers take the weights first: AMX's int8 products with int32 sums do not depend on the row count, so
  a child-process probe (probe.amx_invariant_rows) measures on the model how long a pass keeps
  every row bit-identical to a one-row pass (the default 1.5B target: every length up to 33) and exact
  mode slices by that; where it holds for fewer than INVARIANT_ROWS, the extra buffer types are off and
  slices are INVARIANT_ROWS long;
- llamafile's tinyBLAS (taken for 2+ rows only): the library must be built with GGML_LLAMAFILE=OFF,
  which `llama_build_info()` reports and this module checks;
- the tiled K-quant matmul (taken for 8+ rows): avoided by the slices above. A prompt prefill
  (logits for its last row only) may use it: plain and speculative decoding prefill the same prompt
  identically;
- flash attention (split-KV for one query over 512+ cells, tiled for many queries): disabled, so
  attention is a per-row F16 dot product and a per-row softmax.
Cells are filled in position order (one active sequence, trimmed from the end), so the order of
every attention sum is the same in both runs. tests/test_llamacpp_backend.py checks rows bit for bit.

Exact across sequences (forward_batch, parallel > 1): a sequence's logits are bit-identical whether it
is decoded alone or beside other sequences at other lengths. Two things could couple them:
- kernels: each entry is cut into the slices `forward` would use; slices of at most invariant_rows
  rows (decode steps) share llama_decode calls of at most invariant_rows rows with other sequences'
  slices, where every row takes the row-invariant kernels; a longer slice (a prefill's full batches,
  whose tiled/gemm kernels depend on the rows beside them) is a call of its own with exactly the rows
  it has alone. llama.cpp may cut a call into smaller ubatches (split_equal: equal rows per sequence,
  consecutive sequence ids), never larger ones;
- attention: in a unified buffer the cells of several sequences interleave, so a sequence's attention
  softmax and V sums run over its cells at other indices and SIMD lanes group them differently (a
  few ulps; tests/test_llamacpp_batch.py shows it). With one KV stream per sequence its cells sit at
  indices 0..length-1 of its own stream, as alone; a pass that also serves a longer sequence widens
  the KV view (to the next 256 cells), and the extra cells are masked, adding exact zeros.
Prefill chunks (num_logits 0) are decoded as `forward(tokens, cache, 1)` would decode them: a prompt
prefilled in chunks of a multiple of batch_size rows has the same KV as in one forward. Exact mode with
parallel = 1 keeps the unified buffer: forward_batch works there but is exact for one sequence only.
tests/test_llamacpp_batch.py checks a sequence beside 1-3 others bit for bit, with negative controls.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specdec.backends.base import BatchRows, ModelBackend, check_batch, forward_greedy_in_slices, forward_rows
from specdec.backends.kvcache import ContextOverflowError
from specdec.backends.llamacpp.apart_prefill import ApartPrefill, fill_batch
from specdec.backends.llamacpp.probe import (
    LibraryProbeError,
    amx_invariant_rows,
    amx_rows_agree,
    check_library_runs,
    fingerprint,
    library_file,
)
from specdec.fim import FimTokens
from specdec.host.hugepages import NewRegions, malloc_uses_huge_pages
from specdec.host.native_build import (
    cmake_args,
    compiler_family,
    cpu_flags,
    cpu_model,
    library_mismatch,
    rebuild_command,
)

# The tiled K-quant matmul engages at 8 rows (ggml-cpu/tiled/tiled.cpp: ggml_tiled_min_batch).
INVARIANT_ROWS = 7
# Repacked weights: gemm for each whole group of 4 rows, gemv for the rest (ggml-cpu/repack.cpp).
EXACT_REPACKED_ROWS = 3
DEFAULT_BATCH = 512
MAX_SEQUENCES = 16
# Prompt chunks of at least this many rows are prefilled apart (fast mode, unified buffer, parallel > 1): the
# decode rows beside such a chunk then need a main-context pass of their own (0.13-0.19 s with 3-7 streams on
# the AMX Xeon, 2 threads), and the prefill saves about 1 ms a row beside three streams' cells (700 rows:
# 4.70-4.87 s in the main buffer, 3.99-4.04 s apart): worth it from about 150 rows.
APART_PREFILL_ROWS = 128


class LlamaCppUnavailable(ImportError):
    """llama-cpp-python is not installed (or its shared library failed to load)."""


_INSTALL_HINT = (
    "build it for this CPU with the flags specdec needs: "
    f"{rebuild_command(['$(python3 -m specdec.host.native_build)'])} (see docs/llamacpp.md)"
)

_lock = threading.Lock()
_initialised = False
_log_callback = None  # kept alive: llama.cpp calls it from C


def llama_cpp_module():
    """Import llama_cpp once, initialise the backend and route its logging; LlamaCppUnavailable otherwise."""
    global _initialised, _log_callback
    if not _initialised:
        try:
            check_library_runs()  # a library built for another CPU would kill this process on import
        except LibraryProbeError as exc:
            raise LlamaCppUnavailable(str(exc)) from exc
    try:
        import llama_cpp  # the llamacpp extra, imported only once the probe says this CPU runs it
    except (ImportError, OSError, RuntimeError) as exc:  # a missing or broken libllama raises OSError/RuntimeError
        raise LlamaCppUnavailable(f"the llama.cpp backend needs llama-cpp-python ({exc}); {_INSTALL_HINT}") from exc
    with _lock:
        if not _initialised:
            verbose = os.environ.get("SPECDEC_LLAMACPP_VERBOSE") == "1"

            @llama_cpp.llama_log_callback
            def _log(level, text, user_data):
                # llama.cpp logs every tensor and parameter at load; keep errors unless asked for more.
                if verbose or level == 4:  # GGML_LOG_LEVEL_ERROR
                    os.write(2, text)

            _log_callback = _log
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _initialised = True
    return llama_cpp


def build_features() -> dict[str, bool]:
    """CPU features and build switches of the loaded libllama ("AVX2", "LLAMAFILE", "AMX_INT8", ...)."""
    llama_cpp = llama_cpp_module()
    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    return {name: value == "1" for name, value in re.findall(r"([A-Z0-9_]+) = (\d)", info)}


def batch_invariance_problems(features: dict[str, bool] | None = None) -> list[str]:
    """Why this libllama cannot give batch-invariant rows ([] when it can)."""
    features = build_features() if features is None else features
    problems = []
    if features.get("LLAMAFILE"):
        problems.append("it was built with GGML_LLAMAFILE=ON (tinyBLAS computes batches of 2+ rows differently)")
    return problems


ISA_FEATURES = ("AVX", "AVX2", "FMA", "F16C", "AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16",
                "AMX_INT8")
_isa_warned = False


def _warn_if_library_lacks_isa(features: dict[str, bool]) -> None:
    """Warn once when this CPU has instruction sets the loaded library was not built for (never silently slower)."""
    global _isa_warned
    if _isa_warned:
        return
    _isa_warned = True
    flags = cpu_flags()
    if not flags:
        return
    compiler = compiler_family()
    missing, _ = library_mismatch(features, flags, compiler)
    if missing:
        warnings.warn(
            f"this llama.cpp library does not use {', '.join(missing)}, which this CPU has (a portable build, or one "
            f"made for another CPU), so it runs slower than it could. Rebuild it for this CPU: "
            f"{rebuild_command(cmake_args(flags, compiler))}", stacklevel=3)


def default_threads() -> int:
    """The CPUs this process may run on (not the machine's count: containers and taskset restrict it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class LlamaCppSequence:
    """A KV cache: one llama.cpp sequence of a backend's context; trim(n) removes its last n positions."""

    def __init__(self, backend: "LlamaCppBackend", seq_id: int, capacity: int):
        self._backend = backend
        self.seq_id = seq_id
        self._capacity = capacity
        self.length = 0
        # Give the sequence id back (and free its cells) when the cache object goes away.
        self._finalizer = weakref.finalize(self, backend._release_sequence, seq_id)

    @property
    def capacity(self) -> int:
        return self._capacity

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.length))
        if n:
            self._backend._remove_positions(self.seq_id, self.length - n)
            self.length -= n
        return n


class LlamaCppBackend(ModelBackend):
    """A GGUF model on llama.cpp behind ModelBackend (see the module docstring for batch invariance).

    parallel: sequences that may decode at once, each up to max_context tokens (a server's slots).
    max_sequences: sequence ids (caches) that may exist at once; default max(16, parallel) in a unified
    buffer, parallel with one KV stream per sequence. kv_unified: None chooses (streams for exact mode
    with parallel > 1, else one unified buffer); True/False forces it (tests, experiments).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        name: str | None = None,
        max_context: int = 4096,
        threads: int | None = None,
        batch_invariant: bool = True,
        tokenizer=None,
        batch_size: int = DEFAULT_BATCH,
        extra_buffers: bool | None = None,
        check_amx: bool = True,
        parallel: int = 1,
        max_sequences: int | None = None,
        kv_unified: bool | None = None,
    ):
        llama_cpp = llama_cpp_module()
        if not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel must be an integer >= 1, got {parallel!r}")
        self._llama = llama_cpp
        self.gguf_path = Path(path)
        self.name = name or self.gguf_path.name
        self.tokenizer = tokenizer
        self.threads = threads or default_threads()
        features = build_features()
        _warn_if_library_lacks_isa(features)
        problems = batch_invariance_problems(features) if batch_invariant else []
        self.batch_invariant = batch_invariant and not problems
        self.batch_invariance_problems = problems
        if problems:
            warnings.warn(
                f"{self.name}: this libllama cannot compute rows batch-invariantly ({'; '.join(problems)}), so "
                f"greedy speculative output may differ from plain decoding at near-ties; {_INSTALL_HINT}",
                stacklevel=2,
            )
        amx_library = features.get("AMX_INT8", False)
        self.amx_check: dict | None = None
        self.amx_invariance: dict | None = None
        if extra_buffers is None:
            # Exact mode keeps the repacked weights (row-invariant below 4 rows); on an AMX library the AMX
            # buffers take the weights first, and exact mode keeps them only where the probe below measures
            # rows invariant for at least as long a slice as the stored weights give (unprobed: off).
            extra_buffers = check_amx or not (self.batch_invariant and amx_library)
            if extra_buffers and amx_library and check_amx:
                self.amx_check = amx_rows_agree(self.gguf_path, self.threads)
                if self.amx_check["ok"] is None:
                    extra_buffers = False  # the file did not load in the child: the load below says why
                elif not self.amx_check["ok"]:
                    extra_buffers = False
                    warnings.warn(f"{self.name}: AMX is off for this model: {self.amx_check['why']}. Running "
                                  f"without llama.cpp's extra buffer types (slower); rebuild without AMX with "
                                  f"SPECDEC_AMX=0 and {_INSTALL_HINT}", stacklevel=2)
                elif self.batch_invariant:
                    self.amx_invariance = amx_invariant_rows(self.gguf_path, self.threads)
                    extra_buffers = self.amx_invariance["rows"] >= INVARIANT_ROWS
        self.extra_buffers = extra_buffers
        self.amx = bool(extra_buffers and amx_library)
        # Rows whose logits are returned go through llama_decode in slices this long in exact mode.
        if self.amx and self.amx_invariance is not None:
            self.invariant_rows = self.amx_invariance["rows"]
        else:
            self.invariant_rows = EXACT_REPACKED_ROWS if extra_buffers else INVARIANT_ROWS
        self.features = features

        new_regions = NewRegions()  # what the load allocates gets huge pages (hugepages.py)
        model_params = llama_cpp.llama_model_default_params()
        model_params.use_extra_bufts = extra_buffers
        # Repacked (and AMX) weights are copies: mapping the file as well only leaves its pages resident after the
        # repack read them (the default 1.5B target: 877 MiB of the file stayed mapped and resident beside the
        # copies, 2250 MiB RSS; read into memory instead, 1497 MiB and the same 60 ms one-row step, AMX Xeon, 2
        # threads). Weights as stored are used in place, so there the file stays mapped (no copy at all).
        self.weights_mapped = not extra_buffers
        if extra_buffers:
            _read_weights_into_memory(model_params)
        model = llama_cpp.llama_model_load_from_file(str(self.gguf_path).encode(), model_params)
        if not model:
            raise ValueError(f"llama.cpp could not load {self.gguf_path} (not a GGUF model it supports?)")
        self._model = model
        self.train_context = int(llama_cpp.llama_model_n_ctx_train(model))
        self.max_context = min(max_context, self.train_context) if self.train_context > 0 else max_context
        vocab = llama_cpp.llama_model_get_vocab(model)
        self._vocab = vocab
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self.eos_token_ids = frozenset(
            t for t in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, t)
        )
        self.batch_size = max(self.invariant_rows, min(batch_size, self.max_context))

        # KV memory. One unified buffer (llama.cpp's kv_unified) of parallel * max_context cells that every
        # sequence id may use: parallel = 1 is one active sequence of max_context tokens among MAX_SEQUENCES ids.
        # Exact mode with parallel > 1 gives every sequence id a KV stream of its own instead (kv_unified off),
        # so a sequence's cells never interleave with another's and its attention sums run over the same
        # cells in the same order as alone; each stream holds max_context cells, so max_sequences (default:
        # parallel) streams are allocated.
        self.parallel = parallel
        self.kv_unified = (not (self.batch_invariant and parallel > 1)) if kv_unified is None else bool(kv_unified)
        if max_sequences is None:
            max_sequences = max(MAX_SEQUENCES, parallel) if self.kv_unified else parallel
        limit = int(llama_cpp.llama_max_parallel_sequences())
        if not isinstance(max_sequences, int) or not parallel <= max_sequences <= limit:
            raise ValueError(f"max_sequences must be an integer from parallel ({parallel}) to {limit}, "
                             f"got {max_sequences!r}")
        self.max_sequences = max_sequences
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = self.max_context * (parallel if self.kv_unified else max_sequences)
        ctx_params.n_batch = self.batch_size
        ctx_params.n_ubatch = self.batch_size
        # Fast mode in one unified buffer of several slots keeps one more sequence id for cells parked between
        # requests (park_tail). One slot has no other streams to interleave with: it keeps today's placement.
        parking = self.kv_unified and not self.batch_invariant and parallel > 1 and max_sequences < limit
        self._parking_seq = max_sequences if parking else None
        self.parked_cells = 0
        ctx_params.n_seq_max = max_sequences + (1 if parking else 0)
        ctx_params.kv_unified = self.kv_unified
        ctx_params.n_threads = self.threads
        ctx_params.n_threads_batch = self.threads
        ctx_params.no_perf = True
        if self.batch_invariant:
            ctx_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.flash_attention = "off" if self.batch_invariant else "auto"
        ctx = llama_cpp.llama_init_from_model(model, ctx_params)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise ValueError(f"llama.cpp could not create a context of {self.max_context} tokens for {self.name}")
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        self._batch = llama_cpp.llama_batch_init(self.batch_size, 0, 1)
        self.huge_pages = new_regions.collapse_new()
        # Cells one sequence may fill: llama.cpp pads the context (and each stream) to multiples of 256.
        self.kv_cells = int(llama_cpp.llama_n_ctx(ctx))
        self.sequence_cells = int(llama_cpp.llama_n_ctx_seq(ctx))
        if self.sequence_cells < self.max_context or self.kv_cells < self.max_context * parallel:
            _free_native(llama_cpp, self._batch, ctx, model)
            raise ValueError(f"{self.name}: llama.cpp gave {self.kv_cells} KV cells ({self.sequence_cells} per "
                             f"sequence), fewer than {parallel} x {self.max_context}")
        self._free_sequences = list(range(max_sequences - 1, -1, -1))
        # On a CPU each extra verified row costs 0.3-0.9 of a one-row pass, and the kernels change with the row
        # count: a curve no line through two sizes fits. An adaptive engine measures it on first use (a few
        # seconds) and calibration.cached_pass_costs keeps it per machine, model, library, threads and mode.
        self.pass_costs: dict[int, float] | None = None
        self.calibrate_on_first_use = True
        self.forward_calls = 0
        self.forward_seconds = 0.0
        self.forward_records: list[tuple[int, float]] | None = None  # (tokens, seconds) per call while a probe asks
        # The latest forward / forward_batch: rows it decoded, sequences it served, llama_decode calls it made.
        self.last_pass_rows = 0
        self.last_pass_sequences = 0
        self.last_pass_decodes = 0
        # Fast mode, unified buffer, several slots: long prompt chunks are prefilled in a context of their own
        # (apart_prefill.py), at a fresh context's speed instead of among the running streams' cells.
        self._apart = None
        if self.kv_unified and not self.batch_invariant and parallel > 1:
            try:
                self._apart = ApartPrefill(llama_cpp, model, max_context=self.max_context,
                                           batch_size=self.batch_size, threads=self.threads,
                                           vocab_size=self.vocab_size)
            except BaseException:
                _free_native(llama_cpp, self._batch, ctx, model)
                raise
        self.apart_prefill_rows = APART_PREFILL_ROWS if self._apart is not None else 0
        self.chunks_prefilled_apart = 0  # prompt chunks prefilled in that context
        self._closer = weakref.finalize(self, _free_native, llama_cpp, self._batch, ctx, model, self._apart)

    # -- caches -------------------------------------------------------------------------------------------

    def new_cache(self, capacity: int | None = None) -> LlamaCppSequence:
        capacity = min(capacity or self.max_context, self.max_context)
        if not self._free_sequences:
            raise RuntimeError(f"{self.name}: all {self.max_sequences} llama.cpp sequences are in use")
        seq_id = self._free_sequences.pop()
        self._llama.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
        return LlamaCppSequence(self, seq_id, capacity)

    def _release_sequence(self, seq_id: int) -> None:
        if self._closer.alive:
            self._llama.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
            self._free_sequences.append(seq_id)

    def park_tail(self, cache: LlamaCppSequence, n: int) -> int:
        """Remove cache's last n positions (like trim) but keep their cells taken until `release_parked`.

        Why: in the unified buffer the cells a finished request leaves free lie between the running streams'
        cells, and llama_decode fills free cells lowest first. A prompt prefilled into those holes interleaves
        with the other streams, and flash attention's tiled path (prefill) skips a block of cells only when
        none of them is the prompt's: measured on this repository's default pair, 2 threads, AMX Xeon, a
        512-row chunk took 2.6 s in a fresh context, 3.1-3.2 s in the holes beside three streams, 2.8-2.9 s with
        the holes kept taken (benchmarks/amx-xeon-2core/kv-parking). Fast mode with one unified buffer of several
        slots only: exact mode keeps the placement it was proven with, streams have no holes between sequences,
        and one slot has no other streams (there a plain trim keeps the kernels' paths, and rounding, as before).
        """
        n = max(0, min(n, cache.length))
        if n and self._parking_seq is not None:  # None unless fast mode, one unified buffer, parallel > 1
            self._llama.llama_memory_seq_cp(self._memory, cache.seq_id, self._parking_seq, cache.length - n, -1)
            self.parked_cells += n
        return cache.trim(n)

    def release_parked(self) -> bool:
        """Free the cells `park_tail` kept; True if there were any. forward_batch calls it before a pass in which
        no prompt is written (every row wants logits: verification and drafting), and before retrying a pass that
        found no room."""
        if not self.parked_cells:
            return False
        self._llama.llama_memory_seq_rm(self._memory, self._parking_seq, -1, -1)
        self.parked_cells = 0
        return True

    def _remove_positions(self, seq_id: int, start: int) -> None:
        if not self._llama.llama_memory_seq_rm(self._memory, seq_id, start, -1):
            raise RuntimeError(f"{self.name}: llama.cpp could not remove positions >= {start} of sequence {seq_id}")

    # -- forward ------------------------------------------------------------------------------------------

    def forward(self, tokens: Sequence[int], cache: LlamaCppSequence, num_logits: int = 1) -> torch.Tensor:
        """Append tokens to cache; return float32 logits [num_logits, vocab] for the last num_logits positions."""
        num_logits = forward_rows(tokens, cache, num_logits, self.name)
        return self.forward_batch([BatchRows(tokens, cache, num_logits)])[0]  # the same calls as one sequence alone

    def _count_pass(self, rows: int, sequences: int, decodes: int, began: float) -> None:
        seconds = time.perf_counter() - began
        self.forward_calls += 1
        self.forward_seconds += seconds
        if self.forward_records is not None:
            self.forward_records.append((rows, seconds))
        self.last_pass_rows = rows
        self.last_pass_sequences = sequences
        self.last_pass_decodes = decodes

    def forward_batch(self, batch: Sequence[BatchRows]) -> list[torch.Tensor]:
        """Append every entry's tokens to its cache in one flat llama.cpp batch (rows tagged with their sequence
        ids); return float32 logits [num_logits, vocab] per entry, in order ([0, vocab] for num_logits 0).

        Every entry is checked first (tokens, room, each cache at most once, caches of this backend); on any
        error every cache is rolled back to its length before the call. Fast mode puts all rows in llama_decode
        calls of batch_size rows. Exact mode decodes each entry's rows in the slices `forward` would use
        (`_slices`): slices of at most invariant_rows rows (the row-invariant kernels) share calls of at most
        invariant_rows rows with other sequences' slices, longer slices (prefill) get calls of their own, so a
        sequence's logits are bit-identical to decoding it alone when every sequence has its own KV stream
        (kv_unified off: exact mode with parallel > 1).
        """
        entries = list(batch)
        if len(entries) == 1 and entries[0].greedy_draft is not None and self.batch_invariant \
                and 0 < self.invariant_rows < len(entries[0].tokens):
            # Exact mode decodes verified rows in slices of invariant_rows anyway, so running them one by one
            # gives the same logits, and after a slice whose argmax departs from the draft the later rows can
            # no longer be accepted: a long draft rejected early costs its first slices only.
            return [forward_greedy_in_slices(self, entries[0], self.invariant_rows)]
        wanted = check_batch(entries, self.name,
                             lambda cache: isinstance(cache, LlamaCppSequence) and cache._backend is self)
        if not entries:
            return []
        apart = [i for i, (rows, w) in enumerate(zip(entries, wanted)) if self.prefills_apart(len(rows.tokens), w)]
        here = [i for i in range(len(entries)) if i not in apart]
        if self.parked_cells and all(wanted[i] == len(entries[i].tokens) for i in here):
            self.release_parked()  # no prompt is being written here: decode rows fill the freed cells
        began = time.perf_counter()
        starts = [rows.cache.length for rows in entries]
        calls = [[(here[i], lo, hi) for i, lo, hi in call]
                 for call in self._batch_calls([len(entries[i].tokens) for i in here], [wanted[i] for i in here])]
        outputs: list[list[np.ndarray]] = [[] for _ in entries]
        apart_calls = 0
        try:
            for i in apart:
                entry = entries[i]
                logits = self._apart.prefill(self._ctx, entry.cache.seq_id, starts[i], entry.tokens, wanted[i],
                                             self.release_parked)
                apart_calls += self._apart.calls
                self.chunks_prefilled_apart += 1
                entry.cache.length = starts[i] + len(entry.tokens)
                if wanted[i]:
                    outputs[i].append(logits)
            for call in calls:
                rows, owners = [], []
                for i, lo, hi in call:
                    entry, start = entries[i], starts[i]
                    first_output = len(entry.tokens) - wanted[i]
                    seq_id = entry.cache.seq_id
                    for j in range(lo, hi):
                        rows.append((entry.tokens[j], start + j, seq_id, j >= first_output))
                        if j >= first_output:
                            owners.append(i)
                self._decode_rows(rows)
                for i, lo, hi in call:
                    entries[i].cache.length = starts[i] + hi
                if owners:
                    logits = self._read_logits(len(owners))  # llama.cpp returns them in batch order
                    for i in sorted(set(owners)):
                        outputs[i].append(logits[[k for k, owner in enumerate(owners) if owner == i]])
        except BaseException:
            # Leave every cache exactly as it was before this call.
            for entry, start in zip(entries, starts):
                entry.cache.length = start
                self._llama.llama_memory_seq_rm(self._memory, entry.cache.seq_id, start, -1)
            raise
        results = []
        for parts in outputs:
            if not parts:
                results.append(torch.zeros((0, self.vocab_size), dtype=torch.float32))
            else:
                results.append(torch.from_numpy(np.concatenate(parts) if len(parts) > 1 else parts[0]))
        self._count_pass(sum(len(rows.tokens) for rows in entries), len(entries), len(calls) + apart_calls, began)
        return results

    def prefills_apart(self, rows: int, num_logits: int) -> bool:
        """Whether forward_batch prefills an entry of `rows` tokens wanting `num_logits` logits in the context of
        its own (apart_prefill.py): a prompt chunk (at most its last row's logits) of apart_prefill_rows or more."""
        return bool(self.apart_prefill_rows) and num_logits <= 1 and rows >= self.apart_prefill_rows

    def prompt_rows_beside(self, prompt_rows: int, num_logits: int, other_rows: int) -> int:
        """Fast mode: as many of a prompt chunk's rows as fill one call of batch_size rows with the decode rows
        beside it. A full chunk plus decode rows is two llama_decode calls, and the second, of a few rows, reads
        every weight again (~70-130 ms at 2 threads on the AMX Xeon). Exact mode keeps whole chunks: a prompt's
        keys and values are exact only when it is cut the same way as alone; a chunk prefilled apart gets a call
        of its own anyway."""
        if self.batch_invariant or self.prefills_apart(prompt_rows, num_logits):
            return prompt_rows
        excess = prompt_rows + other_rows - self.batch_size
        return prompt_rows - excess if 0 < excess < prompt_rows else prompt_rows

    def calibration_options(self) -> dict:
        """calibration.measure_pass_costs on llama.cpp: one warm-up pass, then three timed repeats per size."""
        return {"repeats": 3, "warmup": 1}

    def _batch_calls(self, lengths: Sequence[int], wanted: Sequence[int]) -> list[list[tuple[int, int, int]]]:
        """The llama_decode calls of a flat batch: each a list of (entry, lo, hi) row ranges, in decoding order.

        Fast mode: all rows, entry after entry, cut into calls of batch_size rows. Exact mode: each entry's
        slices as `forward` would cut them (a num_logits 0 entry as a prefill, like num_logits 1); a slice of at
        most invariant_rows rows takes the row-invariant kernels in any call of at most invariant_rows rows, so
        such slices of several sequences share calls that long; a longer slice (a prefill's full batches, whose
        kernels depend on the rows beside them) is a call of its own with exactly the rows it has alone.
        """
        calls: list[list[tuple[int, int, int]]] = []
        current: list[tuple[int, int, int]] = []
        size = 0
        if not self.batch_invariant:
            for i, n in enumerate(lengths):
                lo = 0
                while lo < n:
                    take = min(n - lo, self.batch_size - size)
                    current.append((i, lo, lo + take))
                    size += take
                    lo += take
                    if size == self.batch_size:
                        calls.append(current)
                        current, size = [], 0
            if current:
                calls.append(current)
            return calls
        limit = self.invariant_rows
        for i, n in enumerate(lengths):
            for lo, hi in self._slices(n, max(1, wanted[i])):
                if hi - lo > limit:
                    if current:
                        calls.append(current)
                        current, size = [], 0
                    calls.append([(i, lo, hi)])
                    continue
                if size + hi - lo > limit:
                    calls.append(current)
                    current, size = [], 0
                current.append((i, lo, hi))
                size += hi - lo
        if current:
            calls.append(current)
        return calls

    def _slices(self, n: int, num_logits: int) -> list[tuple[int, int]]:
        """Split [0, n) into llama_decode calls of at most batch_size rows.

        Batch-invariant backends decode the rows whose logits are returned in slices of invariant_rows.
        A call that wants only the last row's logits is a prompt prefill and runs in full batches: it is
        computed identically whichever way the prompt is later decoded, and the fast kernels pay there.
        """
        size = self.batch_size
        if num_logits == 1 or not self.batch_invariant:
            return [(lo, min(lo + size, n)) for lo in range(0, n, size)]
        first_output = n - num_logits
        slices = [(lo, min(lo + size, first_output)) for lo in range(0, first_output, size)]
        step = self.invariant_rows
        return slices + [(lo, min(lo + step, n)) for lo in range(first_output, n, step)]

    def decode_together(self, tokens: Sequence[int], cache: "LlamaCppSequence") -> np.ndarray:
        """Append tokens in ONE llama_decode (no slicing: the kernels a pass of len(tokens) rows takes) and
        return every row's logits. For the probes and tests that compare kernels; the engine uses forward."""
        self._decode(tokens, cache.length, cache.seq_id, len(tokens))
        cache.length += len(tokens)
        return self._read_logits(len(tokens))

    def _decode(self, tokens: Sequence[int], first_pos: int, seq_id: int, num_logits: int) -> None:
        """One llama_decode of one sequence's consecutive tokens, logits for the last num_logits of them."""
        first_logit = len(tokens) - num_logits
        self._decode_rows([(token, first_pos + i, seq_id, i >= first_logit) for i, token in enumerate(tokens)])

    def _decode_rows(self, rows: Sequence[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of rows (token, position, sequence id, wants logits), at most batch_size of them."""
        fill_batch(self._batch, rows)
        self._submit(len(rows))

    def _submit(self, count: int) -> None:
        status = self._llama.llama_decode(self._ctx, self._batch)
        if status == 1 and self.release_parked():
            status = self._llama.llama_decode(self._ctx, self._batch)  # the parked cells were the room it lacked
        if status == 1:
            raise ContextOverflowError(f"{self.name}: no room left in the llama.cpp KV cache for {count} tokens")
        if status != 0:
            raise RuntimeError(f"{self.name}: llama_decode failed with status {status}")

    def _read_logits(self, rows: int) -> np.ndarray:
        pointer = self._llama.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(pointer, shape=(rows * self.vocab_size,)).reshape(rows, self.vocab_size).copy()

    def describe(self) -> dict:
        """What a benchmark records about this model and runtime."""
        llama = self._llama
        model_type = ctypes.create_string_buffer(256)
        llama.llama_model_desc(self._model, model_type, len(model_type))
        return {
            "name": self.name, "backend": "llama.cpp", "class": type(self).__name__,
            "llama_cpp_python": getattr(llama, "__version__", None), "gguf": str(self.gguf_path),
            "model": model_type.value.decode("utf-8", "replace"), "parameters": int(llama.llama_model_n_params(self._model)),
            "file_bytes": self.gguf_path.stat().st_size, "vocab_size": self.vocab_size,
            "max_context": self.max_context, "threads": self.threads, "batch_invariant": self.batch_invariant,
            "parallel": self.parallel, "max_sequences": self.max_sequences, "kv_unified": self.kv_unified,
            "huge_pages": self.huge_pages, "weights_mapped": self.weights_mapped,
            "kv_cells": self.kv_cells,
            "runtime": self.runtime_summary(), "amx_check": self.amx_check,
            "batch_invariance_problems": self.batch_invariance_problems,
            "build": llama.llama_print_system_info().decode("utf-8", "replace").strip(),
        }

    def calibration_key(self) -> str:
        """What a measured pass-cost curve depends on: this CPU, the library, the model file, kernels, mode, threads."""
        library = library_file()
        # Not how much memory was collapsed onto huge pages: that varies from load to load (the first load of a
        # process collapses, a second of the same file often finds nothing left to do), and the policies scale the
        # curve to the level they measure anyway.
        return " | ".join([cpu_model() or "unknown CPU", fingerprint(library) if library else "?",
                           fingerprint(self.gguf_path), self.runtime_summary(collapsed=False)])

    def runtime_summary(self, collapsed: bool = True) -> str:
        """One line: instruction sets, kernels and mode (what `specdec generate` prints); collapsed=False leaves out
        the memory collapsed onto huge pages at load."""
        isa = [name for name in ISA_FEATURES if self.features.get(name)]
        kernels = ["repacked weights" if self.extra_buffers else "weights as stored (not repacked)"]
        if self.amx:
            kernels.append("AMX")
        kernels.append(f"flash attention {self.flash_attention}")
        if malloc_uses_huge_pages():
            kernels.append("huge pages (glibc malloc)")
        elif collapsed and self.huge_pages and self.huge_pages["bytes"]:
            kernels.append(f"{self.huge_pages['bytes'] / 2**30:.1f} GiB collapsed onto huge pages")
        mode = (f"exact (verify rows in slices of {self.invariant_rows})" if self.batch_invariant
                else "fast (llama.cpp's batched kernels)")
        return f"llama.cpp {' '.join(isa) or 'no SIMD'}; {', '.join(kernels)}; {mode}; {self.threads} threads"

    # -- vocabulary ---------------------------------------------------------------------------------------

    def token_strings(self) -> list[bytes]:
        """Every token's stored text, by id (for vocabulary checks between two models)."""
        return [self._llama.llama_vocab_get_text(self._vocab, t) for t in range(self.vocab_size)]

    def fim_tokens(self) -> FimTokens:
        """llama.cpp's own FIM ids for this GGUF (its metadata keys, else the token texts it knows), and its BOS
        where the vocabulary adds one: the ids llama-server's /infill lays out."""
        lib, vocab = self._llama, self._vocab

        def present(token: int) -> int | None:
            return int(token) if token is not None and int(token) >= 0 else None

        bos = present(lib.llama_vocab_bos(vocab)) if lib.llama_vocab_get_add_bos(vocab) else None
        return FimTokens(pre=present(lib.llama_vocab_fim_pre(vocab)), suf=present(lib.llama_vocab_fim_suf(vocab)),
                         mid=present(lib.llama_vocab_fim_mid(vocab)), pad=present(lib.llama_vocab_fim_pad(vocab)),
                         rep=present(lib.llama_vocab_fim_rep(vocab)), sep=present(lib.llama_vocab_fim_sep(vocab)),
                         bos=bos)

    def close(self) -> None:
        self._closer()


def _read_weights_into_memory(model_params) -> None:
    """Load without mapping the file: llama-cpp-python 0.3.36 spells it load_mode = LLAMA_LOAD_MODE_NONE (0), older
    bindings use_mmap = False."""
    fields = {name for name, *_ in type(model_params)._fields_}
    if "load_mode" in fields:
        model_params.load_mode = 0
    elif "use_mmap" in fields:
        model_params.use_mmap = False


def _free_native(llama_cpp, batch, ctx, model, apart=None) -> None:
    if apart is not None:
        apart.free()
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


__all__ = [
    "EXACT_REPACKED_ROWS", "INVARIANT_ROWS", "LlamaCppBackend", "LlamaCppSequence", "LlamaCppUnavailable", "batch_invariance_problems",
    "build_features", "default_threads", "llama_cpp_module",
]
