"""``python -m testenv.processnode``: see :mod:`testenv.processnode.cli`."""

import sys

from testenv.processnode.cli import main

sys.exit(main())
