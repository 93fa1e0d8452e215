"""Process plumbing for weightbus's own processes: the event loop, the overhead meter, progress lines, log formatting,
and the step logger to W&B and TensorBoard (``loggers``) for any trainer.

It imports nothing above it, and library code (schemas, rules, bus, producers, consumers, engines, integrations)
never imports it.
"""

__all__: list[str] = []  # the package itself exports nothing; its modules do
