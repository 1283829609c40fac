"""``python -m sage_train``: the same as the ``sage-train`` command."""

from sage_train.cli import main

raise SystemExit(main())
