"""``python -m memcallbacks`` runs the command line."""

from memcallbacks.cli import main

raise SystemExit(main())
