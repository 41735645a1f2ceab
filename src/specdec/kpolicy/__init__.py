"""Draft-length policies: how many tokens each sequence drafts each step, from measured acceptance and pass costs."""
