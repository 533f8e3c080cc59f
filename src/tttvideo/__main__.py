from tttvideo.cli import main

raise SystemExit(main())
