"""sage_torch: the PyTorch twin of :mod:`sage_optax` (SAGE, SinkGD, Lion, APOLLO).

Not implemented yet: it is the subject of the PyTorch issue.  The configuration table and
defaults it will use already live in :mod:`sage_optim`, shared with :mod:`sage_optax`.
"""

__all__: list[str] = []
