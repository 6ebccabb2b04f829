"""The streams scenario: one subscription's delivery by a burst worker."""
