"""A second llama.cpp context over the same weights in which a prompt chunk is prefilled alone, its KV then copied into the main context's sequence: a prefill as fast as in a fresh context, whatever the main buffer holds.

Why: in the main context's unified KV buffer the cells of the running streams interleave, and the cells a
finished request leaves free are holes between them. llama_decode fills free cells from its search head, so a
new prompt lands among the other streams' cells, and flash attention's tiled path (prefill) skips a block of KV
cells only when none of it is the prompt's. Measured on the default pair, 2 threads, the AMX Xeon
(benchmarks/amx-xeon-2core/kv-parking, `apart_prefill_probe.py`): a 700-token prompt took 4.70-4.87 s in the
main buffer beside three streams' cells, 3.99-4.04 s here, copies included (9-16 ms for its 20 MB of KV).

The copy goes through llama_state_seq_get_data / set_data, which carry a sequence's cells, positions and K/V
rows; set_data replaces the destination sequence and places its cells wherever the main buffer has room (their
places no longer matter: decode rows read them through the one-row kernels). Weights are shared; this context
adds its own KV (max_context cells) and compute buffers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from specdec.backends.kvcache import ContextOverflowError

SIDE_SEQUENCE = 0


def fill_batch(batch, rows: Sequence[tuple[int, int, int, bool]]) -> None:
    """Write rows (token, position, sequence id, wants logits) into a llama_batch made for at least that many."""
    for i, (token, pos, seq_id, logits) in enumerate(rows):
        batch.token[i] = int(token)
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq_id
        batch.logits[i] = 1 if logits else 0
    batch.n_tokens = len(rows)


class ApartPrefill:
    """Prefills one sequence at a time in a context of its own and hands the result to the main context."""

    def __init__(self, llama, model, *, max_context: int, batch_size: int, threads: int, vocab_size: int):
        params = llama.llama_context_default_params()
        params.n_ctx = max_context
        params.n_batch = batch_size
        params.n_ubatch = batch_size
        params.n_seq_max = 1
        params.kv_unified = True
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        ctx = llama.llama_init_from_model(model, params)
        if not ctx:
            raise ValueError(f"llama.cpp could not create a prefill context of {max_context} tokens")
        self._llama = llama
        self.ctx = ctx
        self._memory = llama.llama_get_memory(ctx)
        self.batch = llama.llama_batch_init(batch_size, 0, 1)
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.calls = 0  # llama_decode calls of the latest prefill

    def prefill(self, main_ctx, seq_id: int, start: int, tokens: Sequence[int], num_logits: int,
                make_room=None) -> np.ndarray:
        """Append tokens at positions start.. to main_ctx's sequence seq_id (which holds positions 0..start-1),
        computed here; return the float32 logits of the last num_logits rows (num_logits <= 1).

        On any error main_ctx's sequence is left as it was. make_room() -> bool frees cells in main_ctx (parked
        ones) when the copy back finds none; the copy is retried once if it did.
        """
        if num_logits > 1:
            raise ValueError("a prefill apart returns at most its last row's logits")
        llama = self._llama
        before = self._copy(main_ctx, seq_id, self.ctx, SIDE_SEQUENCE) if start else None
        try:
            logits = self._decode(tokens, start, num_logits)
            data = self._read(self.ctx, SIDE_SEQUENCE)
            if not self._write(main_ctx, data, seq_id):
                if not (make_room is not None and make_room() and self._write(main_ctx, data, seq_id)):
                    if before is not None:
                        self._write(main_ctx, before, seq_id)  # its own cells were just freed: it fits again
                    raise ContextOverflowError(f"no room left in the llama.cpp KV cache for {len(tokens)} tokens")
        finally:
            llama.llama_memory_seq_rm(self._memory, SIDE_SEQUENCE, -1, -1)
        return logits

    def _decode(self, tokens: Sequence[int], start: int, num_logits: int) -> np.ndarray:
        llama, batch = self._llama, self.batch
        self.calls = 0
        for lo in range(0, len(tokens), self.batch_size):
            hi = min(lo + self.batch_size, len(tokens))
            fill_batch(batch, [(tokens[j], start + j, SIDE_SEQUENCE, bool(num_logits) and j == len(tokens) - 1)
                               for j in range(lo, hi)])
            status = llama.llama_decode(self.ctx, batch)
            self.calls += 1
            if status == 1:
                raise ContextOverflowError(f"no room left in the prefill context for {len(tokens)} tokens")
            if status != 0:
                raise RuntimeError(f"llama_decode failed with status {status} (prefill context)")
        if not num_logits:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        pointer = llama.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(pointer, shape=(self.vocab_size,)).reshape(1, self.vocab_size).copy()

    def _copy(self, src_ctx, src_seq: int, dst_ctx, dst_seq: int):
        data = self._read(src_ctx, src_seq)
        if not self._write(dst_ctx, data, dst_seq):
            raise ContextOverflowError("no room left in the prefill context for the sequence's earlier positions")
        return data

    def _read(self, ctx, seq_id: int):
        size = int(self._llama.llama_state_seq_get_size(ctx, seq_id))
        data = (ctypes.c_uint8 * size)()
        if int(self._llama.llama_state_seq_get_data(ctx, data, size, seq_id)) != size:
            raise RuntimeError("llama.cpp could not read a sequence's KV state")
        return data

    def _write(self, ctx, data, seq_id: int) -> bool:
        return int(self._llama.llama_state_seq_set_data(ctx, data, len(data), seq_id)) == len(data)

    def free(self) -> None:
        self._llama.llama_batch_free(self.batch)
        self._llama.llama_free(self.ctx)
