from anelab.cli import main

raise SystemExit(main())
