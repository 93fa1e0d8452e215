"""weightbus for slime (THUDM/slime): both halves of a drop-in. See docs/integrations/slime.md."""

from weightbus.integrations.slime.abort import generate, request_id
from weightbus.integrations.slime.rollout import GatedDataBuffer, SlimeRollout, generate_rollout, shutdown

__all__ = ["GatedDataBuffer", "SlimeRollout", "generate", "generate_rollout", "request_id", "shutdown"]
