"""`python -m distserve ...`: the console script, where the package is on the path but not installed."""

from distserve.cli import main

raise SystemExit(main())
