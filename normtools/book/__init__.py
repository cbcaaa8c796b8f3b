"""The book's own helpers, not part of the library: notebook setup and glue (``notebook``),
executing and stripping chapters (``build``), the glossary (``glossary``) and the small
computations behind particular chapters (``analysis``, ``solution``). Sits on top of every
other layer; nothing in normtools imports it.
"""
