"""The stability lab: a toy Transformer with every norm placement (``tinylm``), the text it
trains on (``data``), depth probes (``probes``), the training loop and its measures (``train``)
and experiment grids (``experiments``). Built on the library (``normtools.core``).
"""
