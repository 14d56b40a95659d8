"""``python -m extproc``."""

from extproc.adapters.cli import main

raise SystemExit(main())
