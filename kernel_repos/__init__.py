"""Installed as the data package ``kernel_loader._kernel_repos`` (see pyproject.toml).

This file only makes it a regular package: without it the folder is a namespace package, and
``importlib.resources.files("kernel_loader._kernel_repos")`` returns a ``MultiplexedPath``
instead of the real folder, so code that turns it into a ``Path`` finds no shipped repos.
The kernel repos themselves are the ``<org>/<name>/`` folders beside it, in Hub layout.
"""
