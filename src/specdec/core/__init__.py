"""The pure rules every layer shares: sampling transforms, acceptance rules, the statistics record, confidence intervals, pass-cost curves."""
