"""Process plumbing for weightbus's own processes (the CLI, the RL loop, the demo, the benchmarks): the event
loop, the overhead meter, the progress lines and the log formatting. It imports nothing above it: the RL loop
and the demo supervisor (``weightbus.demo``) use it, never the reverse. Library code (schemas, rules, bus,
producers, consumers, engines, integrations) never imports this package.
"""

__all__: list[str] = []  # the package itself exports nothing; its modules do
