from gateway.node.cli import main

raise SystemExit(main())
