"""Suite-wide setup.

TRITON_INTERPRET must be set before triton is first imported so the Triton kernels run on the
CPU; the cache and Hub variables are pointed at throwaway places so no test touches the user's
cache or the real Hub.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

# The loopback Hub server fixtures (hub_server, hub_env); see tests/hub_server.py.
pytest_plugins = ["hub_server"]
