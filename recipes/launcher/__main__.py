"""`python -m recipes.launcher`: the launcher, as scripts/train_mcore.sh runs it."""

from recipes.launcher.launch import main

raise SystemExit(main())
