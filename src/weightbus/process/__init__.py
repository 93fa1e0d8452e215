"""Process plumbing for weightbus's own processes (the CLI, the RL loop, the demo, the benchmarks): the event
loop, the overhead meter, the progress lines, and the demo supervisor (``process.demo``: its config, children,
faults and loop). Library code (schemas, rules, bus, producers, consumers, engines, integrations) never imports
this package.
"""
