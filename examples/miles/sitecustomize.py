"""For miles' FSDP backend, which has no init hook: put this directory on the workers' PYTHONPATH.

Python runs ``sitecustomize`` in every process; ``install_fsdp`` only registers an import hook, so it
costs nothing in processes that never import miles' FSDP updater (the RolloutManager, the engines).
Settings come from the environment (``WEIGHTBUS_NATS``, ``WEIGHTBUS_POLICY``, ...).
"""

import weightbus.integrations.miles as wb

wb.install_fsdp()
