"""Helpers the tests share: multi-process runners, reference implementations, bad-input tables, rank workers."""
