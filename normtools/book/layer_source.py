"""Read a decoder layer's ``forward()`` as a learner would: only the lines that move the residual stream.

Chapter 2 shows the real source of two transformers decoder layers side by side::

    import inspect
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    lines = residual_path_lines(inspect.getsource(LlamaDecoderLayer.forward))

:func:`residual_path_lines` keeps, in order, the statements of the function body that save or
add the residual, call a norm, call a sublayer (their argument lists folded to ``...``) or
return; :func:`side_by_side` aligns two such listings on their common lines.
"""

import ast
import difflib
import textwrap

_RESIDUAL_WORDS = ("residual", "norm")


def residual_path_lines(source: str, sublayers=("self_attn", "mlp")) -> list[str]:
    """The statements of the function in ``source`` that touch the residual path, one line each.

    A top-level statement of the body is kept when its text names the residual or a norm
    (``residual``, ``norm``), calls one of ``sublayers`` (``self.<name>(``), or returns.
    A statement over several lines (a sublayer call with keyword arguments) is folded to one
    line, ``target = self.self_attn(...)``. Comments, the signature and decorators are dropped.
    """
    source = textwrap.dedent(source)
    function = ast.parse(source).body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError("source must hold one function definition")
    lines = []
    for statement in function.body:
        text = ast.get_source_segment(source, statement)
        calls_sublayer = any(f"self.{name}(" in text for name in sublayers)
        if not (isinstance(statement, ast.Return) or calls_sublayer
                or any(word in text for word in _RESIDUAL_WORDS)):
            continue
        if "\n" in text:  # a call over several lines: keep its head, fold its arguments
            text = text[:text.index("(") + 1] + "...)"
        lines.append(text)
    return lines


def side_by_side(listings: dict) -> "pandas.DataFrame":
    """Two listings (name -> lines) as a two-column table, aligned so that a line the two share
    sits on one row and lines only one of them has face an empty cell (``difflib`` matching)."""
    import pandas as pd

    (left_name, left), (right_name, right) = listings.items()
    rows = []
    matcher = difflib.SequenceMatcher(a=left, b=right, autojunk=False)
    for _, i1, i2, j1, j2 in matcher.get_opcodes():
        block_left, block_right = left[i1:i2], right[j1:j2]
        for k in range(max(len(block_left), len(block_right))):
            rows.append((block_left[k] if k < len(block_left) else "",
                         block_right[k] if k < len(block_right) else ""))
    return pd.DataFrame(rows, columns=[left_name, right_name])
