"""``python -m kernel_loader`` runs the ``kernel-loader`` command line."""

import sys

from kernel_loader.cli import main

sys.exit(main())
