"""Model norm cards: every normalization choice of a model, read from its config or checkpoint.

``spec`` (card types, deriving a card from a transformers config, reading checkpoints, parameter
counts, rendering), ``safetensors_header`` (tensor names and shapes without loading weights),
``patching`` (swap a transformers model's norms for the library's, as its card says) and the
bundled published configs in ``configs/``. Built on the library (``normtools.core``).
"""
