"""The stability lab: a toy Transformer with every norm placement (``tinylm``; its block, one
function per placement, in ``blocks``; one built from a norm card, ``tinylm_from_spec``), the
chain of amplifiers with and without a leveller (``amplifier_chain``), the text it trains on
(``data``), depth probes (``probes``), the training loop and its measures (``train``), the
stability grid (``grid``), the designs of chapter 7 (``designs``), the committed studies
(``studies``) and the reader of their files (``study_files``), their reproducibility check (``reproduce``) and command (``study_cli``), and the
statistics of their verdicts (``verdicts``). Built on the library
(``normtools.core``).
"""
