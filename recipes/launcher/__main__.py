from recipes.launcher.launch import main

raise SystemExit(main())
