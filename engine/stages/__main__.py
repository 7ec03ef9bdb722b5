"""`python -m engine.stages [--readme]`: print the stage table, or rewrite README.md's stage block."""

from engine.stages import main

raise SystemExit(main())
