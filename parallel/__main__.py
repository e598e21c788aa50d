from parallel.cli import main

raise SystemExit(main())
