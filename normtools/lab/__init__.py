"""The stability lab: a toy Transformer with every norm placement (``tinylm``; its block, one
function per placement, in ``blocks``), the text it trains on (``data``), depth probes (``probes``), the training loop and its measures (``train``),
the stability grid (``grid``), the designs of chapter 7 (``designs``) and the committed studies
(``studies``). Built on the library (``normtools.core``).
"""
