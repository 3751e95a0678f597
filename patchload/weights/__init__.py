"""Load once: the leader's share and the follower's assembly, library-neutral.

The layer between the transports (how bytes move, :mod:`patchload.transport`) and the library
patches (:mod:`patchload.patches`): what becomes of a loaded model's weights on each rank,
whichever library loaded them.
"""
