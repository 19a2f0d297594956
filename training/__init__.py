"""unmask training: AR -> diffusion adaptation (A2D) whose outputs the engine serves (docs/design.md#training).

Modules, lowest first (no import cycle, function-level imports included: pyproject.toml's ``acyclic_siblings``
contract): ``common`` (errors, checkpoint discovery, the parent loader, the EOS rule, seeds), ``convert``, ``data``,
``losses``, ``forwards``, ``scopes`` and ``mask_adapter``; the objectives (``objectives/``: ``diffusion``,
``draft``, ``trajectory``) and the experiments (``experimental/``: ``vfm``, Repr-Align) named by ``registry``;
``config`` (``TrainConfig``), ``schedule``, ``checkpoints``, ``metrics`` and ``trainer`` (the loop); then
``distill``, ``export``, ``realmodel`` and ``recipes/``.
"""
