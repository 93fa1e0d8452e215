"""weightbus for slime (THUDM/slime): both halves of a drop-in. See docs/integrations/slime.md."""

__all__: list[str] = []
