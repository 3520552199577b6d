from erniekit_lite.cli import main

raise SystemExit(main())
