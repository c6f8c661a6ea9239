"""``python -m loadgen``: the same command as ``edgegw bench``."""

from loadgen.cli import main

raise SystemExit(main())
