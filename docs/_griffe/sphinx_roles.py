"""A griffe extension for the API reference: the docstrings cite names with Sphinx roles
(:meth:`transport_stats`), which Markdown would show as written; this turns each into a code
span (`transport_stats`)."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:meth|func|class|attr|data|mod|exc|obj|const):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        # Called for every object as it is loaded, the stub's included.
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)
