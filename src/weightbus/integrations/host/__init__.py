"""What every host drop-in shares: its settings, its process' metrics, its groups as weightbus sees them, and the
trainer half's machinery (``install``: the checked, all-or-nothing patch of a host's updaters; ``trainer``: the
core every patched ``update_weights`` runs through; ``cell``, ``session``, ``proxies``, ``runtime``, ``engines``).

A host package (``integrations.miles``, ``integrations.slime``) only translates its host's objects and calls into
these and into the library's mechanisms (its targets, its commit, its plan of an update: ``identity.Host``); two
hosts never import each other. Importing this package never imports a host, torch or ray.
"""

__all__: list[str] = []
