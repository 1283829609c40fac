"""Name conventions of other libraries' models, shared by both routers.

One module per library, named after the library's import name (``transformers.py``).
Unlike the gatherers' adapters these read names only, which a converted state dict keeps
without the library: :data:`sage_optim.naming.NAME_CONVENTIONS` imports every module here
with the first routing by names, and each registers a
:class:`sage_optim.naming.NameConvention`.
"""
