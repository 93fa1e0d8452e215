"""Process plumbing for weightbus's own processes (the CLI, the demo, the benchmarks): the event loop,
the overhead meter and the demo supervisor. Library code (schemas, rules, bus, producers, consumers,
engines, integrations) never imports this package.
"""
