"""The book's own helpers, not part of the library: notebook setup and glue (``notebook``), each
chapter's experiment sizes (``sizes``), executing and stripping chapters (``build``), the Colab
edition (``colab``), the mermaid diagrams rendered to SVG (``diagrams``), the glossary
(``glossary``), and the small computations behind particular chapters: what each QK-Norm scope
normalizes (``qk_norm_scopes``), moving a norm's scale between offset conventions
(``scale_offset``) and per-layer QK-Norm computed shard by shard without communication
(``sharded_qk_norm``), the lines of a decoder layer's forward() that move the residual stream
(``layer_source``), a checkpoint's norm tensors and their values (``checkpoint_norms``), and
chapter 1's figure of one block per norm placement
(``block_figure``). Sits on top of every other layer; nothing in normtools imports it.
"""
