"""What every host drop-in shares: its settings' lookup, its process' metrics, its groups as weightbus sees them.

A host package (``integrations.miles``, ``integrations.slime``) only translates its host's objects and calls into
these and into the library's mechanisms; two hosts never import each other. Importing this package never imports
a host, torch or ray.
"""

__all__: list[str] = []
