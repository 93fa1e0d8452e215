"""Process plumbing for weightbus's own processes: the event loop, the overhead meter, progress lines, log formatting.

It imports nothing above it, and library code (schemas, rules, bus, producers, consumers, engines, integrations)
never imports it.
"""

__all__: list[str] = []  # the package itself exports nothing; its modules do
