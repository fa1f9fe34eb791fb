"""Test helpers that watch the code under test without changing what it does."""

from __future__ import annotations


def count_calls(monkeypatch, owner, name: str) -> dict[str, int]:
    """Replace owner.name (a module function or an instance's method) by a wrapper that counts
    its calls and passes them through; returns {"n": calls so far}, updated live. monkeypatch
    puts the original back after the test."""
    calls = {"n": 0}
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls
