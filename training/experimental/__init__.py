"""Experiments that measured no gain (docs/methods.md), kept working and kept apart: the main loop never branches on
them. ``vfm`` (``--objective vfm``, an objective of the registry) and Repr-Align (``align``, ``anchors``, and
``repr_align``, its auxiliary loss term of the diffusion objectives).
"""
