from tokencapture.cli import main

raise SystemExit(main())
