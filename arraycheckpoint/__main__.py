"""``python -m arraycheckpoint``: the same command as the installed ``arraycheckpoint`` script."""

from __future__ import annotations

from arraycheckpoint.cli import main

raise SystemExit(main())
