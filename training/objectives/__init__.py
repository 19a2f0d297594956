"""The training objectives, one module each behind one interface (:class:`~.base.Objective`; docs/design.md#training):
``diffusion`` (``mdlm``, ``block``), ``draft``, ``trajectory``. ``unmask.training.registry`` names them, with the
experiments of ``unmask.training.experimental``.
"""
