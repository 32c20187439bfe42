from kvmesh.cli import main

raise SystemExit(main())
