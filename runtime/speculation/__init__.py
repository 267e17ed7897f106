"""Speculative decoding: proposing draft tokens (n-gram or draft engine), verifying them, and when to speculate."""
