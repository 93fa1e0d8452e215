"""Adapters that plug weightbus into RL frameworks without importing them (``weightbus.integrations.miles``)."""

__all__: list[str] = []
