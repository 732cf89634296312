"""MkDocs hook: the docstrings use Sphinx's cross-reference roles (``:class:`X```, ``:func:`~a.b.c```), which the
API reference (mkdocstrings, Markdown) shows literally; drop the role and its ``~`` so only the code name remains."""

import re

_ROLE = re.compile(r":(?:class|meth|mod|func|attr|data|obj|exc|const):<code>~?")


def on_page_content(html, **kwargs):
    return _ROLE.sub("<code>", html)
