from recipes.dapo.launch import main

raise SystemExit(main())
