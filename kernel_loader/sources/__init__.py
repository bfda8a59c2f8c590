"""Where kernel repos come from: local overrides, the shipped copies, and the Hub.

The cache is read by ``kernel_loader.cache``; the order in which sources are tried lives in
``kernel_loader.resolver``.
"""
