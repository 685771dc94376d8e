from lucidlm.cli import main

raise SystemExit(main())
