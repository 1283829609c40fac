"""Adapters: the evidence that other libraries' module types give the torch router.

One module per library, named after the library's import name (``transformers.py``,
``peft.py``).  :func:`sage_torch.routing.adapters` imports ``sage_torch.adapters.<library>``
once ``<library>`` is imported (a model cannot hold a module of a library that is not), and
the module registers an :class:`sage_torch.routing.Adapter` with
:func:`sage_torch.routing.register_adapter`.  No adapter imports its library: classes are
looked up in ``sys.modules`` (:func:`sage_torch.routing.loaded_class`).  ``docs/routing.md``
says how to write one for a model the router has never seen.
"""
