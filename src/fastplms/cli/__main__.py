"""`python -m fastplms.cli ...`: the `fastplms` command without the console script."""

from . import main

raise SystemExit(main())
