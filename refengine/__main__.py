from refengine.cli import main

raise SystemExit(main())
