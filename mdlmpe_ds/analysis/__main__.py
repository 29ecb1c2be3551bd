"""Entry point of ``python -m mdlmpe_ds.analysis`` (see :mod:`mdlmpe_ds.analysis.cli`)."""

import sys

from mdlmpe_ds.analysis.cli import main

sys.exit(main())
