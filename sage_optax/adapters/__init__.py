"""Adapters: the evidence that other libraries' models give the JAX router.

One module per library, named after the library's import name (``equinox.py``).
:func:`sage_optax.routing.adapters` imports ``sage_optax.adapters.<library>`` once
``<library>`` is imported (a tree cannot hold a module of a library that is not), and the
module registers an :class:`sage_optax.routing.Adapter` with
:func:`sage_optax.routing.register_adapter`.  ``docs/routing.md`` says how to write one.
"""
