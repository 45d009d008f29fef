"""``python -m h2o_compile.cli``: the h2o-compile command."""

import sys

from . import main

sys.exit(main())
