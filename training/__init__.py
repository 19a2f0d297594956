"""unmask training: AR -> diffusion adaptation (A2D) whose outputs the engine serves (docs/design.md#training; the
module layers: docs/design.md#layout-and-layers).

Modules, lowest first (no import cycle, function-level imports included: pyproject.toml's ``acyclic_siblings``
contract): ``common`` (errors, checkpoint discovery, the parent loader, the EOS rule, seeds) and ``jsonl``;
``convert``, ``data``, ``distill``; ``scopes``, ``mask_adapter``, ``forwards``, ``distributed``; ``losses`` and the
objectives (``objectives/``: ``diffusion``, ``draft``, ``trajectory``); the experiments (``experimental/``: ``vfm``,
Repr-Align); ``registry``, ``config`` (``TrainConfig``), ``schedule``, ``checkpoints``, ``metrics`` and ``trainer``
(the loop); then ``export``, ``realmodel`` and ``recipes/``.
"""
