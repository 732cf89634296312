"""MkDocs hooks (not pages):

* the docstrings use Sphinx's cross-reference roles (``:class:`X```, ``:func:`~a.b.c```), which the API reference
  (mkdocstrings, Markdown) shows literally; drop the role and its ``~`` so only the code name remains;
* the parts of pages written from the code (``<!-- generated: NAME -->``) are generated here, and each notebook
  becomes a page under ``notebooks/``: :mod:`reference_pages` beside this file says how.
"""

import importlib.util
import re
from pathlib import Path

from mkdocs.structure.files import File

_ROLE = re.compile(r":(?:class|meth|mod|func|attr|data|obj|exc|const):<code>~?")
_spec = importlib.util.spec_from_file_location("reference_pages", Path(__file__).with_name("reference_pages.py"))
reference_pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference_pages)


def on_files(files, config, **kwargs):
    for notebook in sorted(reference_pages.NOTEBOOKS.glob("*.ipynb")):
        files.append(File.generated(config, f"notebooks/{notebook.stem}.md",
                                    content=reference_pages.notebook_page(notebook)))
    return files


def on_page_markdown(markdown, **kwargs):
    return reference_pages.render(markdown)


def on_page_content(html, **kwargs):
    return _ROLE.sub("<code>", html)
