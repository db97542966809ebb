"""``python -m memcallbacks`` runs the command line."""

from memcallbacks._cli import main

raise SystemExit(main())
