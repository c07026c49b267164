"""Tiers written for vLLM's ``SecondaryTierManager`` run in our tiering manager (placeholder)."""

from __future__ import annotations


def register_vllm_tiers() -> None:
    """Make the vLLM-written tier types known to our SecondaryTierFactory (idempotent)."""
