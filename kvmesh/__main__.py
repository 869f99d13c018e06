"""`python -m kvmesh`: the `kvmesh` command."""

import sys

from kvmesh.cli import main

sys.exit(main())
