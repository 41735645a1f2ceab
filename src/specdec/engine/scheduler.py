"""Continuous batching: running sequences each with their own drafter, k policy, sampling, stops and budget; one
step drafts for all, runs the target once over a flat batch of their rows, verifies each with the pure rules,
trims each cache, and returns per-sequence outputs. Sequences join and leave at step boundaries."""

from __future__ import annotations

import copy
import itertools
import time
from typing import Callable, Sequence

import torch

from specdec.backends.base import BatchRows, ModelBackend
from specdec.backends.kvcache import ContextOverflowError, common_prefix_length
from specdec.config import SamplingParams, SpecConfig
from specdec.core.logprobs import row_logprobs
from specdec.core.partitions import PartitionLRU
from specdec.core.penalties import penalty_processor
from specdec.core.processors import LogitsProcessor, allowed_draft_length, chain, process_rows, settle
from specdec.core.sampling import greedy_tokens, make_generator, positional_choices, probabilities
from specdec.core.stats import SpecStats
from specdec.core.verify import Verdict, verify_greedy, verify_sampled
from specdec.drafters.base import Draft, Drafter
from specdec.engine.output import StepOutput
from specdec.engine.sequence import RunningSequence, Slot, StepPlan
from specdec.engine.textstream import TextStream
from specdec.kpolicy.adaptive import Ewma
from specdec.kpolicy.calibration import DEFAULT_SIZES, cached_pass_costs, measure_pass_costs
from specdec.kpolicy.draft_lengths import choose_draft_lengths
from specdec.kpolicy.factory import make_policy


class BatchEngine:
    """Runs up to max_running sequences together over one target and a drafter per slot.

    `add` admits a request (refused at once when it cannot fit); `step` advances every running sequence by one
    target pass; `abort` ends one between steps. A prompt is prefilled in chunks of at most prefill_chunk tokens
    per step, so a new request does not stall the running streams for its whole length, and the pass that
    prefills its last chunk gives its first token (llama-server and vLLM do the same). One prompt's chunk per
    pass, the shortest remaining prompt first (see _prefill_plans); a last chunk prefilled in a context of its own
    runs in a step of its own, ahead of the decoding streams' pass (_first_token_goes_ahead). Draft rows are priced
    at what they add to this step's pass (load-aware): chosen together for the sequences whose policies learn from
    plans (row_allocation), by each policy alone for the others (AdaptiveK.other_rows).
    """

    def __init__(self, target, drafter: Drafter | None = None, spec: SpecConfig | None = None,
                 decode: Callable[[Sequence[int]], str] | None = None, prefix_cache: bool | None = None,
                 max_running: int = 1, prefill_chunk: int | None = None):
        self.target = target
        self.spec = spec or SpecConfig()
        self.decode = decode or default_decoder(target)
        self.prefix_cache = bool(self.spec.prefix_cache if prefix_cache is None else prefix_cache)
        self.prefill_chunk = max(1, int(prefill_chunk or target.batch_size))
        self._slot_group = object()  # what this engine's slots share (kvcache.RetainedPrefix groups)
        self.slots = [Slot(drafter)]
        self.set_max_running(max_running)
        self.running: list[RunningSequence] = []
        self.total_stats = SpecStats()
        # Adaptive policies kept for the engine's lifetime: per partition (PartitionLRU), per draft source.
        self.kept_policies: PartitionLRU[dict[str | None, object]] = PartitionLRU(dict)
        self.last_pass_rows = 0
        self.shared_pass_costs: dict[int, Ewma] = {}  # rows -> seconds of decode-only passes of 2+ sequences
        self.last_sequence: RunningSequence | None = None  # the latest admitted (its stats: SpeculativeEngine.last_stats)
        self._decoders_next = False  # a prompt's last chunk went ahead of the decoding streams: they run next step
        self._ids = itertools.count()
        self._grammars = None

    # -- configuration ------------------------------------------------------------------------------------

    def set_max_running(self, max_running: int) -> None:
        """How many sequences may run together from the next admission on (a server's --parallel)."""
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if self.drafter is not None and max_running > 1 and not self.drafter.can_spawn:
            raise ValueError(f"the {self.drafter.name} drafter cannot serve several sequences at once (no spawn())")
        self.max_running = max_running

    @property
    def drafter(self) -> Drafter | None:
        return self.slots[0].drafter

    @property
    def reuses_prefix(self) -> bool:
        """Whether a request may keep the cache prefix it shares with its slot's previous request (see
        SpeculativeEngine.reuses_prefix: never on a batch-invariant target)."""
        return self.prefix_cache and not self.target.batch_invariant

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Refuse a request that cannot fit, before any work is done."""
        if len(prompt) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        limit = self.target.max_context
        if len(prompt) + params.max_tokens > limit:
            raise ContextOverflowError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the model context "
                f"of {limit} tokens"
            )
        vocab = self.target.vocab_size
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if params.constrained:
            # Compiled here, before any work (cached by the grammar's hash: admission finds it done).
            self.grammars.compile_for(params)

    @property
    def grammars(self):
        """The target's grammar compiler (grammar/compiler.py), made on first use: compiled schemas are cached."""
        if self._grammars is None:
            from specdec.grammar.compiler import GrammarCompiler  # llguidance imports transformers (seconds)

            self._grammars = GrammarCompiler(self.target.tokenizer, self.target.vocab_size, self.target.eos_token_ids)
        return self._grammars

    def grammar_for(self, params: SamplingParams):
        """The request's grammar processor (None without json_schema or lark_grammar); GrammarError (a ValueError) if refused."""
        if not params.constrained:
            return None
        return self.grammars.processor(self.grammars.compile_for(params))

    @property
    def adaptive_policies(self) -> dict[object, object]:
        """The kept policies as one mapping: by draft source for the shared partition (no partitions: what a
        library user and the bench read), by (partition, source) for the others."""
        return {(source if partition is None else (partition, source)): policy
                for partition, kept in self.kept_policies.items() for source, policy in kept.items()}

    @property
    def has_room(self) -> bool:
        return len(self.running) < self.max_running

    def cache_of(self, slot: Slot):
        if slot.cache is None:
            slot.cache = self.target.new_cache(self.target.max_context)
        return slot.cache

    def calibrate(self, sizes=None) -> dict[int, float]:
        """Measure the target's pass cost per row count on slot 0's cache (calibration.py) and keep it on the
        backend, where every adaptive policy made afterwards reads it: 1 to k + 1 rows, and up to
        max_running * (k + 1) (at most 64) when several sequences may share a pass. Only between requests."""
        if self.running:
            raise RuntimeError("calibrate only while no sequence is running")
        slot = self.slots[0]
        cache = self.cache_of(slot)
        k = self.spec.num_speculative_tokens
        # Several sequences share a pass: the load-aware policy reads the curve up to all their rows.
        most = min((k + 1) * self.max_running, max(DEFAULT_SIZES))
        sizes = sizes or sorted({s for s in DEFAULT_SIZES if s <= most} | {1, k + 1})
        options = self.target.calibration_options()

        def measure(wanted):
            slot.retained.drop()  # the measurement empties the cache
            return measure_pass_costs(self.target, wanted, cache=cache, **options)

        costs = cached_pass_costs(self.target, sizes, measure)
        self.target.pass_costs = costs
        return costs

    # -- admission and leaving ----------------------------------------------------------------------------

    def add(self, prompt: Sequence[int], params: SamplingParams, tag: object = None,
            partition: object = None, processor: LogitsProcessor | None = None) -> RunningSequence:
        """Admit a request into a free slot (the one whose cache shares the longest prefix with the prompt).

        partition (hashable; None for one local user) says who may share cross-request state: the request
        reuses a slot's cached prefix, a draft model's cached prefix, the suffix cache and the adaptive policies'
        acceptance only where its own partition left them, so no other partition's text can speed it up (or be
        read back through its timing or its statistics).

        processor (core/processors.py): the request's own logits processor (a grammar), applied after the
        penalties and logit_bias its params ask for, at every verified row as plain decoding would."""
        prompt = [int(t) for t in prompt]
        self.check_request(prompt, params)
        processor = chain([penalty_processor(params, prompt, self.target.vocab_size), self.grammar_for(params),
                           processor])
        if not self.has_room:
            raise RuntimeError(f"all {self.max_running} sequences are running; admit at a step boundary")
        if self.spec.k_policy == "adaptive" and self.target.calibrate_on_first_use \
                and self.target.pass_costs is None and self.drafter is not None and not self.running:
            self.calibrate()  # a GPU's nearly free rows, a CPU's kinked curve: no line through two sizes shows them
        slot = self._free_slot(prompt, partition)
        same_partition = slot.partition == partition
        began = time.perf_counter()
        stats = SpecStats(num_prompt_tokens=len(prompt))
        sequence = RunningSequence(
            request_id=next(self._ids), prompt=prompt, params=params, slot=slot,
            generator=make_generator(params.seed, self.target.device),
            eos=frozenset() if params.ignore_eos else self.target.eos_token_ids,
            text=TextStream(self.decode, params.stop), stats=stats, began=began, context=list(prompt), tag=tag,
            partition=partition, processor=processor)
        cache = self.cache_of(slot)
        # The slots keep their prefixes side by side while the target's memory is sized for all of them
        # (llama.cpp: `parallel` sequences; torch: a memory per cache); beyond that, as separate owners.
        room = self.target.parallel or len(self.slots)
        slot.retained.group = self._slot_group if len(self.slots) <= room else None
        # Keep the longest common prefix of what the slot's cache holds and prompt[:-1]; prefill only the rest (at
        # least the last prompt token, whose logits give the first token).
        # A request scoring its prompt needs every prompt row's logits: no cached prefix has them.
        sequence.prefilled = slot.retained.claim(self.target, cache, prompt[:-1],
                                                 self.reuses_prefix and same_partition and not sequence.scores_prompt)
        slot.partition = partition
        stats.num_cached_prompt_tokens = sequence.prefilled
        slot.sequence = sequence
        self.running.append(sequence)
        self.last_sequence = sequence
        drafter = slot.drafter
        try:
            if drafter is not None:
                # One switch for both caches (a draft model's), and never across partitions.
                drafter.prefix_cache = self.prefix_cache and same_partition
                drafter.set_partition(partition)
                drafter.begin(prompt, params, sequence.generator)
            if self.max_running == 1:
                for kept in (self.kept_policies.peek(partition) or {}).values():
                    kept.begin_request()  # acceptance is the request's content: old evidence fades
        except BaseException:
            self._leave(sequence, "error", clean=False)
            raise
        return sequence

    def _free_slot(self, prompt: list[int], partition: object) -> Slot:
        free = [slot for slot in self.slots if slot.sequence is None]
        if len(self.slots) < self.max_running and not any(
                slot.partition == partition or not slot.retained.tokens for slot in free):
            free = []  # a slot of its own before another partition's cached prefix is overwritten
        if not free:
            drafter = self.slots[0].drafter
            free = [Slot(drafter.spawn() if drafter is not None else None)]
            self.slots += free
        # llama-server's slot choice: the idle slot whose cached tokens share the longest prefix with the prompt,
        # among the slots of the request's own partition; else the slot of another partition holding least.
        return max(free, key=lambda slot: (common_prefix_length(slot.retained.tokens, prompt[:-1])
                                           if slot.partition == partition else -len(slot.retained.tokens) - 1))

    def abort(self, sequence: RunningSequence) -> None:
        """End a running sequence between steps (a client gone, a newer request on a one-slot engine)."""
        if not sequence.finished:
            self._leave(sequence, "abort", clean=True)

    def _leave(self, sequence: RunningSequence, reason: str, clean: bool) -> None:
        """Free the sequence's slot; the cache keeps its tokens when the invariant holds (cache = context - 1)."""
        sequence.finish_reason = sequence.finish_reason or reason
        stats = sequence.stats
        stats.total_seconds = time.perf_counter() - sequence.began
        self.total_stats.merge(stats)
        if self.max_running > 1 and self.spec.k_policy == "adaptive":
            # What this sequence learnt is its partition's newest evidence.
            self.kept_policies.get(sequence.partition).update(sequence.policies)
        slot = sequence.slot
        cache = slot.cache
        if sequence in self.running:
            self.running.remove(sequence)
        slot.sequence = None
        # Between steps the cache holds the prompt prefilled so far, or once decoding, the context but its last token.
        held = sequence.prompt[: sequence.prefilled] if sequence.prefilling else sequence.context[:-1]
        if clean and cache.length == len(held):
            slot.retained.tokens = held
            slot.retained.release(self.reuses_prefix)
        else:
            slot.retained.drop()  # an error mid-step: what the cache holds is not certain
        drafter = slot.drafter
        if drafter is not None:
            try:
                if reason != "error":
                    drafter.observe(sequence.context)  # everything emitted, for a drafter that learns from outputs
            finally:
                drafter.end()

    # -- one step -----------------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Advance every running sequence by one target pass; returns an output per decoding sequence (a sequence
        still prefilling gives none), and for each sequence that failed while planning, its error."""
        if not self.running:
            return []
        outputs: list[StepOutput] = []
        decoding = [s for s in self.running if not s.prefilling]
        plans = [] if self._decoders_next and decoding else self._prefill_plans()
        self._decoders_next = False
        if plans and decoding and self._first_token_goes_ahead(plans[0]):
            decoding, self._decoders_next = [], True
        prefill_rows = sum(len(p.rows.tokens) for p in plans)
        forced = self._forced_tokens(decoding, outputs)
        decoding = [s for s in decoding if not s.finished]
        # The forced tokens' rows are in the pass before any draft is priced (the drafter continues after them).
        chosen = self._choose_drafts(decoding, prefill_rows + sum(map(len, forced.values())), outputs, forced)
        for group in self._drafting_groups(chosen):
            try:
                drafts = self._draft(group)
            except Exception as exc:  # noqa: BLE001 - the sequences whose drafts failed end; the others go on
                for sequence, _, _, _ in group:
                    self._leave(sequence, "error", clean=False)
                    outputs.append(_failed(sequence, exc))
                continue
            for (sequence, policy, k, prefix), draft in zip(group, drafts):
                drafted = draft.tokens[: max(k, 0)]
                offered = len(drafted)
                proposed = prefix + drafted
                if sequence.processor is not None and drafted:
                    # Drafts that leave the processor's language end where they leave it (a grammar); the forced
                    # tokens are the language's only continuation, so the cut falls after them.
                    proposed = proposed[: allowed_draft_length(sequence.processor, proposed, draft.probs is not None)]
                sequence.stats.draft_seconds += draft.seconds
                rows = BatchRows([sequence.context[-1]] + proposed, sequence.slot.cache, len(proposed) + 1)
                plans.append(StepPlan(sequence, rows, decode=True, proposed=proposed,
                                      draft=_after_forced(prefix, draft, self.target.vocab_size), policy=policy,
                                      offered=offered, forced=len(prefix)))
        if not plans:
            return outputs
        self._fit_prompt_chunk_beside_decode_rows(plans)
        if len(plans) == 1 and plans[0].decode and plans[0].sequence.params.greedy \
                and plans[0].sequence.processor is None:
            # The backend may stop at the raw argmax's first departure (a processed row may still agree: not then).
            plans[0].rows.greedy_draft = plans[0].proposed
        began = time.perf_counter()
        try:
            logits = self.target.forward_batch([p.rows for p in plans])
        except BaseException as exc:
            # The backend rolled every cache back to before the call; the sequences in it end, with the error.
            for plan in plans:
                self._leave(plan.sequence, "error", clean=False)
                outputs.append(_failed(plan.sequence, exc))
            if not isinstance(exc, Exception):
                raise
            return outputs
        target_seconds = time.perf_counter() - began
        # Rows the pass computed (a greedy verification stopped early computes fewer than it was given).
        self.last_pass_rows = sum(len(rows_logits) if p.decode else len(p.rows.tokens) for p, rows_logits in zip(plans, logits))
        if len(plans) > 1 and all(p.decode for p in plans):
            self._record_shared_pass(self.last_pass_rows, target_seconds)
        for plan, rows_logits in zip(plans, logits):
            sequence = plan.sequence
            try:
                if plan.decode:
                    outputs.append(self._finish_decode(plan, rows_logits, target_seconds, len(plans) > 1))
                    continue
                if sequence.scores_prompt:
                    self._score_prompt_rows(sequence, len(plan.rows.tokens), rows_logits)
                sequence.prefilled += len(plan.rows.tokens)
                if not sequence.prefilling:
                    sequence.stats.prefill_seconds = time.perf_counter() - sequence.began
                    outputs.append(self._first_token(sequence, rows_logits[-1:]))
            except Exception as exc:  # noqa: BLE001 - that sequence's verification failed; the others go on
                self._leave(sequence, "error", clean=False)
                outputs.append(_failed(sequence, exc))
        return outputs

    def _forced_tokens(self, decoding: list[RunningSequence], outputs: list[StepOutput]) -> dict[int, list[int]]:
        """By id(sequence), the tokens each decoding sequence's processor forces next (a grammar's fixed text: a
        property name, a closing brace; [] for none): they open this step's draft, free of the drafter, which
        continues after them, all verified in the same pass as the others' rows (DESIGN.md section 9). A processor
        that fails ends its sequence here."""
        forced: dict[int, list[int]] = {}
        for sequence in decoding:
            tokens: list[int] = []
            if sequence.processor is not None:
                try:
                    tokens = [int(t) for t in sequence.processor.forced()[: max(self._draft_room(sequence), 0)]]
                except Exception as exc:  # noqa: BLE001 - that sequence's grammar failed; the others go on
                    self._leave(sequence, "error", clean=False)
                    outputs.append(_failed(sequence, exc))
                    continue
            forced[id(sequence)] = tokens
        return forced

    def _first_token_goes_ahead(self, prompt: StepPlan) -> bool:
        """Whether this prompt chunk runs alone, the decoding streams' pass in the next step (which then takes no
        prompt chunk): when it ends its prompt and the backend prefills it in a call of its own (prefills_apart).

        Such a chunk and the streams' rows are two calls anyway; in one step the first token would wait for the
        streams' pass too (0.25 s for seven streams on the 2-vCPU EPYC, 2 threads, llama.cpp). In two steps, chunk
        then streams, the same passes run in the same order of cost, the first token comes out after the chunk,
        and the streams' tokens come out when they did (after both)."""
        rows = prompt.rows
        return not prompt.decode and rows.num_logits == 1 and self.target.prefills_apart(len(rows.tokens), 1)

    def _fit_prompt_chunk_beside_decode_rows(self, plans: list["StepPlan"]) -> None:
        """Shorten this pass's prompt chunk to what the backend runs best beside the decode rows
        (prompt_rows_beside); the rest of the chunk waits for the next step."""
        if plans[0].decode or len(plans) == 1:
            return
        prompt = plans[0]
        rows = prompt.rows
        others = sum(len(p.rows.tokens) for p in plans[1:])
        keep = self.target.prompt_rows_beside(len(rows.tokens), rows.num_logits, others)
        if keep < len(rows.tokens):  # no longer the prompt's last row
            prompt.rows = BatchRows(rows.tokens[:keep], rows.cache, keep if prompt.sequence.scores_prompt else 0)

    def _record_shared_pass(self, rows: int, seconds: float, alpha: float = 0.1) -> None:
        """Keep what a decode-only pass of several sequences costs per row count (a running mean, then an EWMA):
        the price the load-aware policy reads for shared passes of that size, instead of the calibration's."""
        self.shared_pass_costs.setdefault(rows, Ewma(alpha)).add(seconds)

    def _prefill_plans(self) -> list[StepPlan]:
        """This step's prefill: one chunk of the waiting prompt with the fewest tokens left to prefill.

        Shortest first, one prompt per pass: on a CPU a pass costs about in proportion to its rows (llama-bench,
        1.5B Q4_K_M, 2 threads, EPYC: 80 prompt tok/s at 16 rows, 92 at 64, 105 from 128), so packing two prompts
        into one pass makes the first wait for the second's whole prefill and saves little; served one after
        the other, shortest first, their first tokens come out in the least total time (the shortest-processing-
        time rule). A prompt passed over ages: the rows prefilled for others while it waited count against its
        length, so it is served after at most its own length of others' prompt rows.

        A sequence's chunks are always whole (prefill_chunk tokens from where its prefill began, the last one
        shorter), whatever else runs: a batch-invariant target computes a prompt's keys and values exactly as
        alone only if its rows are split the same way. The chunk that ends the prompt asks for its last row's
        logits, the first token's.
        """
        waiting = [s for s in self.running if s.prefilling]
        if not waiting:
            return []
        sequence = min(waiting, key=lambda s: (len(s.prompt) - s.prefilled - s.passed_over, s.request_id))
        size = min(self.prefill_chunk, len(sequence.prompt) - sequence.prefilled)
        for other in waiting:
            if other is not sequence:
                other.passed_over += size
        tokens = sequence.prompt[sequence.prefilled:sequence.prefilled + size]
        last = sequence.prefilled + size == len(sequence.prompt)
        wanted = len(tokens) if sequence.scores_prompt else 1 if last else 0
        return [StepPlan(sequence, BatchRows(tokens, sequence.slot.cache, wanted), decode=False)]

    def _policy(self, sequence: RunningSequence, source: str | None):
        """The k policy of one draft source for this sequence.

        The adaptive cost model measures the hardware and that source's acceptance, which outlive a request, so
        it is kept for the engine's lifetime, per partition (acceptance is learnt from a partition's text): a
        one-slot engine uses it directly; with several slots each sequence works on its own copy (acceptance is
        per request) and hands it back when it leaves.
        """
        if self.spec.k_policy == "adaptive" and self.max_running == 1:
            kept = self.kept_policies.get(sequence.partition)
            if source not in kept:
                kept[source] = self._new_policy()
            return kept[source]
        owner = sequence.policies
        if source not in owner:
            kept = self.kept_policies.get(sequence.partition).get(source) if self.spec.k_policy == "adaptive" else None
            if kept is not None:
                owner[source] = copy.deepcopy(kept)
                owner[source].begin_request()
            else:
                owner[source] = self._new_policy()
        return owner[source]

    def _new_policy(self):
        return make_policy(self.spec.k_policy, self.spec.num_speculative_tokens, self.target.pass_costs)

    def _choose_drafts(self, deciders: list[RunningSequence], rows_in_pass: int, outputs: list[StepOutput],
                       forced: dict[int, list[int]]) -> list[tuple[RunningSequence, object, int, list[int]]]:
        """This step's (sequence, policy, k, forced tokens) for every decoding sequence (the lengths:
        kpolicy/draft_lengths.py; k drafted after the forced tokens); a sequence whose drafter failed ends here."""
        options = []
        for sequence in deciders:
            prefix = forced.get(id(sequence), [])
            try:
                options.append((sequence, *self._draft_option(sequence, prefix), prefix))
            except Exception as exc:  # noqa: BLE001 - a drafter failed: that sequence ends, the others go on
                self._leave(sequence, "error", clean=False)
                outputs.append(_failed(sequence, exc))
        ks = choose_draft_lengths([(policy, cap) for _, policy, cap, _ in options], rows_in_pass)
        return [(sequence, policy, k, prefix) for (sequence, policy, _, prefix), k in zip(options, ks)]

    def _draft_option(self, sequence: RunningSequence, forced: list[int]) -> tuple[object, int]:
        """The k policy of the source that drafts for this sequence this step, after the forced tokens, and the most
        it may draft (None, 0: no draft). A drafter that plans (suffix, prompt lookup) has its plan scored by the
        policy and caps k."""
        # Invariant: the target cache holds every context token except the last.
        drafter = sequence.slot.drafter
        if drafter is None:
            return None, 0
        # Sources differ in acceptance and cost (an n-gram copy vs a draft model), so each has its own policy;
        # None means the drafter has nothing to propose: a plain step.
        context = sequence.context + forced
        source = drafter.next_source(context)
        if source is None:
            return None, 0
        policy = self._policy(sequence, source)
        cap = self._draft_room(sequence) - len(forced)  # the policy still decides at a step with no room (k 0)
        # A deterministic drafter's plan is a function of the context, so the tokens that follow score it whatever
        # k is chosen: a policy that learns from plans learns acceptance from every step, never drafting to find out.
        planned = drafter.plan(context) if policy.can_learn_from_plans else None
        if planned is not None:
            policy.learn_from_plans()
            sequence.plans.add(len(context), planned, policy)
            cap = min(cap, len(planned), policy.max_k)
        policy.shared_pass_costs = self.shared_pass_costs
        return policy, cap

    @staticmethod
    def _draft_room(sequence: RunningSequence) -> int:
        """The most draft tokens a step may verify: one less than both the tokens still to generate and the cache's
        free cells (the step's last token is the verdict's)."""
        remaining = sequence.params.max_tokens - sequence.generated
        room = sequence.slot.cache.capacity - len(sequence.context)
        return min(remaining - 1, room - 1)

    @staticmethod
    def _drafting_groups(chosen: list) -> list[list]:
        """The sequences whose drafters can draft together (one draft model: its forwards share passes), and each
        other sequence on its own, in order."""
        groups: list[list] = []
        together: dict[tuple, list] = {}
        for entry in chosen:
            drafter = entry[0].slot.drafter
            batch_key = drafter.batch_key() if entry[2] > 0 else None
            if batch_key is None:
                groups.append([entry])
                continue
            key = (type(drafter), batch_key)
            if key not in together:
                together[key] = []
                groups.append(together[key])
            together[key].append(entry)
        return groups

    @staticmethod
    def _draft(group: list) -> list[Draft]:
        """Each (sequence, policy, k, forced) entry's draft, continuing its context after the forced tokens."""
        if len(group) > 1:
            drafter = group[0][0].slot.drafter
            return type(drafter).propose_batch([(s.slot.drafter, s.context + prefix, k) for s, _, k, prefix in group])
        sequence, _, k, prefix = group[0]
        return [sequence.slot.drafter.propose(sequence.context + prefix, k) if k > 0 else Draft([])]

    def _finish_decode(self, plan: StepPlan, logits: torch.Tensor, target_seconds: float, shared: bool) -> StepOutput:
        sequence, proposed, draft = plan.sequence, plan.proposed, plan.draft
        stats = sequence.stats
        draft_probs = draft.probs[: len(proposed)] if draft.probs is not None else None
        verdict = self._verdict(sequence, proposed, draft_probs, logits)
        stats.target_seconds += target_seconds
        # The forced tokens come first; the drafter's own tokens follow them (each counted apart).
        forced_accepted = min(verdict.num_accepted, plan.forced)
        drafted, drafted_accepted = len(proposed) - plan.forced, verdict.num_accepted - forced_accepted
        drafter = sequence.slot.drafter
        if drafter is not None and plan.offered:
            # What the drafter proposed, not what a processor let through: its own state holds all it proposed.
            drafter.accepted(drafted_accepted, plan.offered)
        if plan.policy is not None:
            # A pass shared with other sequences (or holding forced rows) says what the whole pass cost, not what
            # this draft's rows added: the policy prices those from the measured curve instead (AdaptiveK.other_rows).
            plan.policy.update(drafted, drafted_accepted, draft.seconds,
                               0.0 if shared or plan.forced else target_seconds, draft.catchup_seconds)
        stats.record_step(drafted, drafted_accepted)
        stats.record_forced(plan.forced, forced_accepted)
        return self._emit(sequence, proposed[: verdict.num_accepted] + [verdict.next_token],
                          [True] * verdict.num_accepted + [False])

    @staticmethod
    def _verdict(sequence: RunningSequence, proposed: list[int], draft_probs: torch.Tensor | None,
                 logits: torch.Tensor) -> Verdict:
        """The verification rule for one sequence's logits rows: greedy match, or rejection sampling; a processor's
        transform applied to each row after its own prefix first, its state left after the verdict's tokens."""
        processor = sequence.processor
        if processor is None:
            verdict = BatchEngine._verdict_of_rows(sequence, proposed, draft_probs, logits)
        else:
            processed, advanced = process_rows(processor, logits, proposed)
            verdict = BatchEngine._verdict_of_rows(sequence, proposed, draft_probs, processed)
            settle(processor, advanced, verdict.num_accepted, verdict.next_token)
        if sequence.params.logprobs is not None:  # row i scored the context before token i: plain decoding's row
            tokens = proposed[: verdict.num_accepted] + [verdict.next_token]
            sequence.pending_logprobs = row_logprobs(logits, tokens, sequence.params.logprobs)
        return verdict

    @staticmethod
    def _verdict_of_rows(sequence: RunningSequence, proposed: list[int], draft_probs: torch.Tensor | None,
                         logits: torch.Tensor) -> Verdict:
        params = sequence.params
        if params.greedy:
            choices = greedy_tokens(logits).tolist()
            # A sliced verification may have stopped early: then its last row holds the first disagreement.
            return verify_greedy(proposed[: len(choices) - 1], choices)
        target_probs = probabilities(logits, params)
        if draft_probs is None and params.seed is not None:
            # A seeded request with no draft distribution (plain decoding, a model-free drafter): the token at
            # each output position is drawn with noise keyed by (seed, position) alone, so the draft is kept
            # while it equals those draws and the text is plain decoding's for that seed, token for token.
            choices = positional_choices(target_probs, params.seed, sequence.generated)
            return verify_greedy(proposed[: len(choices) - 1], choices)
        if draft_probs is not None and draft_probs.shape[-1] < target_probs.shape[-1]:
            # A draft may score fewer ids than the target (a pruned head over an embedding table that still
            # reads every target id); it never proposes the ids it lacks: q = 0 there.
            draft_probs = torch.nn.functional.pad(draft_probs, (0, target_probs.shape[-1] - draft_probs.shape[-1]))
        return verify_sampled(proposed, draft_probs, target_probs, sequence.generator)

    @staticmethod
    def _score_prompt_rows(sequence: RunningSequence, rows: int, logits: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens this chunk's rows predict: row i of a chunk starting at
        position a scored the prompt's first a + i + 1 tokens, so it gives token a + i + 1 (the chunk's last row
        gives the next chunk's first token, or for the last chunk the first generated token: not a prompt's)."""
        start = sequence.prefilled
        following = sequence.prompt[start + 1 : start + rows + 1]
        if sequence.prompt_logprobs is None:
            sequence.prompt_logprobs = []
        sequence.prompt_logprobs += row_logprobs(logits[: len(following)], following, sequence.params.prompt_logprobs)

    def _first_token(self, sequence: RunningSequence, logits: torch.Tensor) -> StepOutput:
        """The token the prompt's last row gives: the verification rule with nothing drafted, as in plain decoding;
        the pass was the prefill's, so it is not counted as a decoding step. With max_tokens 0 (a prompt scored
        only) no token is kept: the request ends "length"."""
        output = self._emit(sequence, [self._verdict(sequence, [], None, logits).next_token], [False])
        output.prompt_logprobs = sequence.prompt_logprobs
        return output

    def _emit(self, sequence: RunningSequence, new_tokens: list[int], new_from_draft: list[bool]) -> StepOutput:
        """Append a step's tokens to the sequence, cut at EOS, a stop string or max_tokens; trim the cache to the
        context minus its last token; end the sequence when it finished."""
        params, stats = sequence.params, sequence.stats
        remaining = params.max_tokens - sequence.generated
        finish = None
        for i, token in enumerate(new_tokens):
            if token in sequence.eos:
                new_tokens, new_from_draft, finish = new_tokens[: i + 1], new_from_draft[: i + 1], "stop"
                break
        if len(new_tokens) >= remaining:
            new_tokens, new_from_draft = new_tokens[:remaining], new_from_draft[:remaining]
            finish = finish or "length"
        text = sequence.text
        visible = [t for t in new_tokens if t not in sequence.eos]  # EOS can only be the last token
        pushed_before = len(text.tokens)
        delta = text.push(visible)
        if text.stopped:
            # The tokens end at the one that completes the stop string, as in plain decoding: the tokens after it
            # in this step (and an EOS behind them) are not generated.
            kept = len(text.tokens) - pushed_before
            new_tokens, new_from_draft, finish = new_tokens[:kept], new_from_draft[:kept], "stop"
        elif finish is not None:
            delta += text.flush()
        sequence.context += new_tokens
        sequence.plans.resolve(sequence.context)
        sequence.generated += len(new_tokens)
        # One rollback restores the invariant (cache = context minus its last token): it drops the rejected draft
        # tokens and, when EOS, a stop string or max_tokens cut the accepted ones, those too.
        cache = sequence.slot.cache
        cache.trim(cache.length - (len(sequence.context) - 1))
        stats.num_generated_tokens = sequence.generated
        stats.total_seconds = time.perf_counter() - sequence.began
        logprobs, sequence.pending_logprobs = sequence.pending_logprobs, None
        if logprobs is not None:
            logprobs = logprobs[: len(new_tokens)]  # cut where the tokens were (EOS, a stop string, max_tokens)
        if finish is not None:
            sequence.finish_reason = finish
            self._leave(sequence, finish, clean=True)
        return StepOutput(sequence.request_id, new_tokens, new_from_draft, delta, finish, stats=stats,
                          logprobs=logprobs)


def _after_forced(forced: list[int], draft: Draft, vocab_size: int) -> Draft:
    """The step's whole draft: the forced tokens, then the drafter's. A stochastic draft's q gets a one-hot row per
    forced token (the rejection rule accepts it with the processed target's probability of it, which is 1)."""
    if not forced:
        return draft
    probs = draft.probs
    if probs is not None:
        # Over the target's ids: a pruned draft head may lack a forced id (its q is 0 on the ids it lacks).
        probs = torch.nn.functional.pad(probs, (0, max(vocab_size - probs.shape[-1], 0)))
        one_hot = torch.zeros(len(forced), probs.shape[-1], dtype=probs.dtype, device=probs.device)
        one_hot[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
        probs = torch.cat([one_hot, probs])
    return Draft(forced + list(draft.tokens), probs, draft.seconds, draft.catchup_seconds)


def _failed(sequence: RunningSequence, error: BaseException) -> StepOutput:
    """The record of a sequence that an error ended (it has left the engine)."""
    return StepOutput(sequence.request_id, [], [], "", "error", error, sequence.stats)


def default_decoder(backend: ModelBackend) -> Callable[[Sequence[int]], str]:
    """Token ids to text by the backend's tokenizer (ids joined by spaces where it has none)."""
    tokenizer = backend.tokenizer
    if tokenizer is not None:
        return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
    return lambda ids: " ".join(str(i) for i in ids)


__all__ = ["BatchEngine", "RunningSequence", "Slot", "default_decoder"]
