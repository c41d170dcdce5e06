"""Helpers the tests share (not tests themselves)."""
