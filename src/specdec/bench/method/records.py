"""A run's statistics as JSON-ready numbers and back: what results.json stores of a SpecStats."""

from __future__ import annotations

from specdec.core.stats import SpecStats


def raw_stats(stats: SpecStats) -> dict:
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos),
        "num_drafts_per_pos": list(stats.num_drafts_per_pos),
        "num_target_forwards": stats.num_target_forwards,
        "num_generated_tokens": stats.num_generated_tokens,
        "num_prompt_tokens": stats.num_prompt_tokens,
        # Prompt tokens a prefix cache kept from the previous request (not prefilled); 0 without one.
        "num_cached_prompt_tokens": int(getattr(stats, "num_cached_prompt_tokens", 0) or 0),
        "draft_seconds": round(stats.draft_seconds, 6),
        "target_seconds": round(stats.target_seconds, 6),
        "prefill_seconds": round(stats.prefill_seconds, 6),
        "total_seconds": round(stats.total_seconds, 6),
    }


def stats_from_raw(raw: dict) -> SpecStats:
    stats = SpecStats()
    for key, value in raw.items():
        if hasattr(stats, key):
            setattr(stats, key, list(value) if isinstance(value, list) else value)
    return stats
