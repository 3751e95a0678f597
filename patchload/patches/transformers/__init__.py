"""The patches of transformers, one module per part of the library they coordinate:
:mod:`~patchload.patches.transformers.materialize` (where a converting load's tensors are made)
and :mod:`~patchload.patches.transformers.remote_code` (``trust_remote_code`` module files)."""
