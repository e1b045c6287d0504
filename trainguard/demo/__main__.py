from trainguard.demo.run import main

raise SystemExit(main())
