from autosplit.cli import main

raise SystemExit(main())
